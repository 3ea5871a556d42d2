from __future__ import annotations

import pytest
import torch

from specserve_kernels.silu_mul import silu_mul, silu_mul_ref


@pytest.mark.parametrize(
    "num_tokens, inter, dtype",
    [
        (7, 384, torch.float32),
        (9, 2048, torch.bfloat16),  # two column blocks
        (3, 1100, torch.float16),  # not a multiple of the block
        (0, 64, torch.float32),  # an empty step
    ],
)
def test_silu_mul_matches_reference(device, rng, tolerances, num_tokens, inter, dtype):
    x = (3 * torch.randn(num_tokens, 2 * inter, generator=rng)).to(dtype)
    got = silu_mul(x.to(device))
    expected = silu_mul_ref(x.double())
    assert got.dtype == dtype and got.shape == (num_tokens, inter)
    torch.testing.assert_close(got.cpu().double(), expected, **tolerances[dtype])


def test_silu_mul_strided_rows(device, rng):
    buffer = torch.randn(6, 300, generator=rng)
    x = buffer[::2, :256]  # rows of a wider buffer
    torch.testing.assert_close(silu_mul(x.to(device)).cpu(), silu_mul_ref(x))


def test_silu_mul_rejects_bad_arguments(device):
    with pytest.raises(ValueError, match="2 \\* intermediate_size"):
        silu_mul(torch.zeros(2, 7, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul(torch.zeros(8, 4, device=device).t())
    with pytest.raises(ValueError, match="dtype"):
        silu_mul(torch.zeros(2, 8, dtype=torch.int32, device=device))
