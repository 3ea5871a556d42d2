from __future__ import annotations

import pytest
import torch

from specserve_kernels.paged_attention import paged_attention_ref
from specserve_kernels.paged_attention_decode import paged_decode_attention

CASES = [  # block_size, num_heads, num_kv_heads, head_dim, dtype, num_splits
    (8, 4, 4, 64, torch.float32, 1),  # MHA
    (16, 8, 2, 128, torch.bfloat16, 1),  # GQA 4
    (32, 16, 2, 64, torch.float16, 1),  # GQA 8
    (128, 8, 1, 128, torch.float32, 1),  # GQA 8, one KV head
    (64, 8, 2, 64, torch.bfloat16, 4),  # split-KV
    (8, 16, 2, 128, torch.float32, 3),  # split-KV, small blocks
    (16, 4, 1, 32, torch.float16, 2),  # tiny head_dim
    (16, 6, 2, 48, torch.float32, 1),  # group of 3, head_dim not a power of two
]


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, dtype, num_splits", CASES)
def test_decode_matches_reference(
    make_paged_batch, tolerances, rng, block_size, num_heads, num_kv_heads, head_dim, dtype, num_splits
):
    # ragged contexts: one token, exactly one block, random lengths over several blocks
    seq_lens = [1, block_size] + torch.randint(2, 300, (2,), generator=rng).tolist()
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5

    out = paged_decode_attention(*batch.args(), scale, num_splits=num_splits)

    expected = paged_attention_ref(*batch.float64_args(), scale)
    assert out.dtype == dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out.double(), expected, **tolerances[dtype])


def test_decode_split_equals_unsplit(make_paged_batch, tolerances):
    """Splits of unequal work, some empty (the 5-token request has one tile for 5 splits)."""
    batch = make_paged_batch([5, 200, 129], [1, 1, 1], 8, 2, 64, 16, torch.float32, fused_qkv=True)
    unsplit = paged_decode_attention(*batch.args(), 0.125, num_splits=1)
    split = paged_decode_attention(*batch.args(), 0.125, num_splits=5)
    torch.testing.assert_close(split, unsplit, atol=1e-6, rtol=1e-6)
    expected = paged_attention_ref(*batch.float64_args(), 0.125)
    torch.testing.assert_close(unsplit.double(), expected, **tolerances[torch.float32])


@pytest.mark.parametrize("block_n", [16, 128])
def test_decode_any_tile_width_gives_the_reference(make_paged_batch, tolerances, block_n):
    """Tiles narrower and wider than a block (16 tokens here), as the benchmark tries them."""
    batch = make_paged_batch([1, 16, 150, 300], [1] * 4, 8, 2, 64, 16, torch.bfloat16)
    out = paged_decode_attention(*batch.args(), 0.125, num_splits=1, block_n=block_n)
    expected = paged_attention_ref(*batch.float64_args(), 0.125)
    torch.testing.assert_close(out.double(), expected, **tolerances[torch.bfloat16])
    with pytest.raises(ValueError, match="block_n"):
        paged_decode_attention(*batch.args(), 0.125, block_n=48)


def test_decode_rejects_several_queries_per_request(make_paged_batch):
    batch = make_paged_batch([4, 6], [2, 1], 4, 4, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="one query per request"):
        paged_decode_attention(*batch.args(), 0.125)
