"""The public entry point: dispatch, argument checks, split-KV heuristic, end to end."""
from __future__ import annotations

import pytest
import torch
import triton

import specserve_kernels.paged_attention_decode as decode
import specserve_kernels.paged_attention_extend as extend
from specserve_kernels.launch import check_device
from specserve_kernels.paged_attention import paged_attention, paged_attention_ref


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """Replaces both kernels' wrappers with recorders."""
    calls = []

    def recorder(name):
        def run(q, *args, **kwargs):
            calls.append(name)
            return torch.zeros_like(q)

        return run

    monkeypatch.setattr(decode, "paged_decode_attention", recorder("decode"))
    monkeypatch.setattr(extend, "paged_extend_attention", recorder("extend"))
    return calls


@pytest.mark.parametrize(
    "q_lens, max_seqlen_q, expected",
    [
        ([1, 1, 1], None, "decode"),
        ([1, 1, 1], 1, "decode"),
        ([1, 1, 1], 4, "extend"),  # an upper bound is a valid hint; extend is right for any batch
        ([2, 0, 1], None, "extend"),  # as many queries as requests, but not one each
        ([5, 1], None, "extend"),
        ([0, 0], None, "extend"),
    ],
)
def test_dispatch(make_paged_batch, calls, q_lens, max_seqlen_q, expected):
    batch = make_paged_batch([8] * len(q_lens), q_lens, 4, 2, 64, 8, torch.float32)
    paged_attention(*batch.args(), 0.125, max_seqlen_q, None)
    assert calls == [expected]


@pytest.mark.parametrize(
    "batch, num_kv_heads, max_seqlen_k, num_sms, expected",
    [
        (64, 8, 2048, 132, 1),  # 512 programs fill 132 SMs
        (8, 8, 4096, 132, 5),  # 64 programs: ceil(264 / 64) splits
        (1, 8, 32768, 132, 32),  # capped at 32
        (2, 8, 1000, 132, 3),  # 1000 tokens: at most 3 splits of >= 256
        (1, 2, 200, 132, 1),  # too short to split
    ],
)
def test_default_num_splits(batch, num_kv_heads, max_seqlen_k, num_sms, expected):
    assert decode.default_num_splits(batch, num_kv_heads, max_seqlen_k, num_sms) == expected


def test_decode_batch_end_to_end(make_paged_batch, tolerances):
    batch = make_paged_batch([3, 97, 64], [1, 1, 1], 16, 2, 128, 32, torch.float16, fused_qkv=True)
    out = paged_attention(*batch.args(), 0.09, 1, batch.max_seqlen_k)
    expected = paged_attention_ref(*batch.float64_args(), 0.09)
    torch.testing.assert_close(out.double(), expected, **tolerances[torch.float16])


def test_mixed_batch_end_to_end(make_paged_batch, tolerances):
    """A prompt, a decode and a verification of 2 drafts in one flat batch, no hints."""
    batch = make_paged_batch([40, 77, 19], [40, 1, 3], 8, 1, 64, 16, torch.bfloat16)
    out = paged_attention(*batch.args(), 0.125)
    expected = paged_attention_ref(*batch.float64_args(), 0.125)
    torch.testing.assert_close(out.double(), expected, **tolerances[torch.bfloat16])


def _args(device, *, q_dtype=torch.float32, num_heads=4, head_dim=64, q_stride=1, seq_lens_dtype=torch.int32,
          cu_len=3, cache_dtype=torch.float32):
    q = torch.zeros(2, num_heads, head_dim * q_stride, dtype=q_dtype, device=device)[..., ::q_stride]
    cache = torch.zeros(4, 8, 2, head_dim, dtype=cache_dtype, device=device)
    return (
        q, cache, cache.clone(), torch.arange(cu_len, dtype=torch.int32, device=device),
        torch.full((2,), 5, dtype=seq_lens_dtype, device=device),
        torch.zeros(2, 1, dtype=torch.int32, device=device), 0.125,
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(q_dtype=torch.float16), "q dtype torch.float16 must match the KV cache dtype"),
        (dict(q_dtype=torch.float64, cache_dtype=torch.float64), "KV cache dtype must be one of"),
        (dict(num_heads=3), "num_heads 3 must be a multiple of num_kv_heads 2"),
        (dict(q_stride=2), "q must be contiguous in its last dim"),
        (dict(head_dim=512), "head_dim 512 is above the supported 256"),
        (dict(seq_lens_dtype=torch.float32), "seq_lens must be int32 or int64"),
        (dict(cu_len=2), "cu_seqlens_q must have batch \\+ 1 = 3 entries"),
    ],
)
def test_rejects_bad_arguments(device, kwargs, message):
    with pytest.raises(ValueError, match=message):
        paged_attention(*_args(device, **kwargs))


def _kernel_stub(x):
    pass


def test_compiled_kernels_refuse_cpu_tensors():
    gpu_kernel = triton.runtime.JITFunction(_kernel_stub)
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
        check_device(gpu_kernel, torch.zeros(1))


def _attention_by_formula(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query at a time, reading each position's K/V through the
    block table: the definition the reference (and through it every kernel) is held to."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for b in range(seq_lens.shape[0]):
        start, end, length = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seq_lens[b])
        for t in range(start, end):
            pos = length - (end - t)  # this query's position; it sees positions 0..pos
            blocks = block_tables[b, torch.arange(pos + 1) // block_size].long()
            offsets = torch.arange(pos + 1) % block_size
            for h in range(q.shape[1]):
                k = k_cache[blocks, offsets, h // group]  # [pos + 1, head_dim]
                v = v_cache[blocks, offsets, h // group]
                out[t, h] = torch.softmax(k @ q[t, h] * scale, 0) @ v
    return out


@pytest.mark.parametrize(
    "seq_lens, q_lens, num_heads, num_kv_heads",
    [
        ([9, 40, 17, 3], [1, 1, 1, 1], 4, 2),  # decodes of different lengths
        ([21, 12], [4, 4], 8, 1),  # verifications of 3 drafts
        ([30, 9, 16, 50], [2, 1, 5, 20], 4, 4),  # padded short queries beside a long chunk
        ([19, 19], [19, 0], 6, 2),  # a whole prompt and a request with nothing this step
    ],
)
def test_reference_matches_the_formula(make_paged_batch, seq_lens, q_lens, num_heads, num_kv_heads):
    batch = make_paged_batch(seq_lens, q_lens, num_heads, num_kv_heads, 16, 8, torch.float64)
    batch = type(batch)(*(x.cpu() if isinstance(x, torch.Tensor) else x for x in
                          (batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
                           batch.block_tables, batch.max_seqlen_q, batch.max_seqlen_k)))
    got = paged_attention_ref(*batch.args(), 0.3)
    torch.testing.assert_close(got, _attention_by_formula(*batch.args(), 0.3), atol=1e-12, rtol=1e-12)
