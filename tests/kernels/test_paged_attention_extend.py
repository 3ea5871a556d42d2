from __future__ import annotations

import pytest
import torch

from specserve_kernels.paged_attention import paged_attention_ref
from specserve_kernels.paged_attention_extend import paged_extend_attention

CASES = [  # block_size, num_heads, num_kv_heads, head_dim, dtype
    (8, 4, 4, 64, torch.float32),  # MHA
    (16, 8, 2, 128, torch.bfloat16),  # GQA 4
    (32, 16, 2, 64, torch.float16),  # GQA 8
    (128, 8, 1, 128, torch.float32),  # GQA 8, one KV head
    (64, 4, 4, 128, torch.float16),
    (16, 4, 1, 32, torch.bfloat16),  # tiny head_dim
    (16, 6, 2, 48, torch.float32),  # group of 3, head_dim not a power of two
]


def _mixed_batch(rng: torch.Generator) -> tuple[list[int], list[int]]:
    """Whole prompt, chunk after a prefix hit, idle request, decode, verification of 3 drafts."""
    seq_lens = torch.randint(20, 160, (5,), generator=rng).tolist()
    chunk = int(torch.randint(2, 19, (1,), generator=rng))
    return seq_lens, [seq_lens[0], chunk, 0, 1, 4]


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, dtype", CASES)
def test_extend_matches_reference(
    make_paged_batch, tolerances, rng, block_size, num_heads, num_kv_heads, head_dim, dtype
):
    seq_lens, q_lens = _mixed_batch(rng)
    batch = make_paged_batch(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5

    out = paged_extend_attention(*batch.args(), scale, batch.max_seqlen_q, batch.max_seqlen_k)

    expected = paged_attention_ref(*batch.float64_args(), scale)
    assert out.dtype == dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out.double(), expected, **tolerances[dtype])


def test_extend_long_prefill_strided_q(make_paged_batch, tolerances):
    """Several query tiles per request (GQA 4: 16 tokens a tile), q a view of a fused QKV output,
    no host-side hints."""
    batch = make_paged_batch([70, 33], [70, 30], 8, 2, 64, 16, torch.float32, fused_qkv=True)
    out = paged_extend_attention(*batch.args(), 0.125)
    expected = paged_attention_ref(*batch.float64_args(), 0.125)
    torch.testing.assert_close(out.double(), expected, **tolerances[torch.float32])


@pytest.mark.parametrize("num_heads, num_kv_heads, dtype, num_splits", [
    (8, 2, torch.float32, 3),  # GQA 4
    (9, 3, torch.bfloat16, 8),  # the default model's group of 3
    (4, 4, torch.float16, 16),  # splits past the contexts' tiles: some ranges empty
])
def test_split_kv_verification_matches_reference(make_paged_batch, tolerances, num_heads, num_kv_heads, dtype,
                                                 num_splits):
    """Verification (k + 1 queries at the end of a long context), its context split in ranges:
    with a split per K/V tile (16), the request of 130 has a range starting at position 128 (a
    tile boundary for any tile of <= 128 tokens), which its queries at 126 and 127 see none of:
    they must weigh nothing there."""
    seq_lens, q_lens = [300, 130, 520, 1], [4, 4, 2, 1]
    batch = make_paged_batch(seq_lens, q_lens, num_heads, num_kv_heads, 64, 16, dtype)
    expected = paged_attention_ref(*batch.float64_args(), 0.125)
    split = paged_extend_attention(*batch.args(), 0.125, batch.max_seqlen_q, batch.max_seqlen_k, num_splits=num_splits)
    torch.testing.assert_close(split.double(), expected, **tolerances[dtype])
    unsplit = paged_extend_attention(*batch.args(), 0.125, batch.max_seqlen_q, batch.max_seqlen_k, num_splits=1)
    torch.testing.assert_close(split, unsplit, **tolerances[dtype])


def test_split_kv_needs_one_query_tile_per_request(make_paged_batch):
    batch = make_paged_batch([70, 33], [70, 30], 8, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="num_splits"):
        paged_extend_attention(*batch.args(), 0.125, num_splits=2)
    assert paged_extend_attention(*batch.args(), 0.125).shape == batch.q.shape  # no split chosen itself
