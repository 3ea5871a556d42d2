"""The CPU attention kernel (kernels/specserve_kernels/paged_attention_cpu.c) against the torch reference
(kernels/specserve_kernels/paged_attention.py) on ragged batches: decodes, prefills, chunks after cached context,
verification rows, grouped heads, table padding that holds ids outside the pool, requests with no
queries, and scores far apart (the exponential's underflow); its operator in a compiled graph."""
from __future__ import annotations

import pytest
import torch

from specserve_kernels import paged_attention_cpu
from specserve_kernels.paged_attention import paged_attention_ref

pytestmark = pytest.mark.skipif(not paged_attention_cpu.available(), reason="needs an x86 CPU with AVX2 and a C compiler")


def batch(q_lens, seq_lens, heads, kv_heads, head_dim, block_size=16, pool=64, seed=0, garbage=True):
    """A step over a pool of random K/V: each request's pages drawn at random from the pool, its
    table padded past them with ids outside the pool (garbage) or 0."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=g)
    width = max(1, max(-(-n // block_size) for n in seq_lens)) + 1
    tables = torch.full((len(seq_lens), width), 10**6 if garbage else 0, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        pages = -(-n // block_size)
        tables[b, :pages] = torch.randperm(pool, generator=g)[:pages].int()
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, head_dim, generator=g)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), tables


CASES = {
    "decode, one request": ([1], [37]),
    "decode, several": ([1, 1, 1, 1], [1, 16, 17, 200]),
    "prefill": ([13], [13]),
    "prefill of many pages": ([300], [300]),
    "chunk after cached context": ([20], [85]),
    "mixed with verification rows": ([5, 1, 40, 3], [70, 9, 40, 3]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
def test_kernel_equals_the_reference(case, heads, kv_heads, head_dim):
    q_lens, seq_lens = CASES[case]
    args = batch(q_lens, seq_lens, heads, kv_heads, head_dim)
    got = paged_attention_cpu.paged_attention(*args, head_dim**-0.5)
    expected = paged_attention_ref(*args[:3], *args[3:], head_dim**-0.5)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_a_request_with_no_queries_is_skipped():
    """Compiled steps pad the batch with requests of no tokens (and length 0): they change nothing."""
    q, k, v, cu, lens, tables = batch([6], [6], 9, 3, 64)
    padded = (torch.cat([cu, cu[-1:]]), torch.cat([lens, lens.new_zeros(1)]), torch.cat([tables, tables[:1] * 0]))
    torch.testing.assert_close(paged_attention_cpu.paged_attention(q, k, v, *padded, 0.125),
                               paged_attention_cpu.paged_attention(q, k, v, cu, lens, tables, 0.125), atol=0, rtol=0)


def test_scores_far_apart():
    """Keys whose scores differ by hundreds: the softmax's small weights underflow to 0 as in float32."""
    q, k, v, cu, lens, tables = batch([4], [50], 9, 3, 64, garbage=False)
    k = k * torch.linspace(0.1, 60, 16).view(1, 16, 1, 1)
    got = paged_attention_cpu.paged_attention(q, k, v, cu, lens, tables, 1.0)
    torch.testing.assert_close(got, paged_attention_ref(q, k, v, cu, lens, tables, 1.0), atol=2e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


def test_other_dtypes_take_the_reference():
    q, k, v, cu, lens, tables = batch([3, 1], [3, 20], 4, 2, 32)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    assert not paged_attention_cpu.supports(q, k)
    assert torch.equal(paged_attention_cpu.paged_attention(q, k, v, cu, lens, tables, 0.2),
                       paged_attention_ref(q, k, v, cu, lens, tables, 0.2))


def test_the_operator_in_a_compiled_graph():
    q, k, v, cu, lens, tables = batch([5, 1, 7], [30, 2, 7], 9, 3, 64)

    @torch.compile(fullgraph=True, dynamic=True)
    def f(q):
        return paged_attention_cpu.paged_attention_op(q * 2, k, v, cu, lens, tables, 0.125) + 1

    torch.testing.assert_close(f(q), paged_attention_cpu.paged_attention(q * 2, k, v, cu, lens, tables, 0.125) + 1,
                               atol=0, rtol=0)
