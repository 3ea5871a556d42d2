from __future__ import annotations

import pytest
import torch

from kernels.gemv import MAX_ROWS, gemv, gemv_ref


@pytest.mark.parametrize(
    "m, n, k, dtype, bias",
    [
        (1, 96, 384, torch.float32, False),  # a decode step of the default model's shape family
        (3, 200, 130, torch.float32, True),  # n and k not multiples of a tile
        (MAX_ROWS, 64, 256, torch.bfloat16, True),
        (8, 48, 1024, torch.float16, False),  # several k tiles
        (0, 32, 64, torch.float32, False),  # an empty step
    ],
)
def test_gemv_matches_reference(device, rng, tolerances, m, n, k, dtype, bias):
    x = torch.randn(m, k, generator=rng).to(dtype)
    w = (torch.randn(n, k, generator=rng) / k**0.5).to(dtype)
    b = torch.randn(n, generator=rng).to(dtype) if bias else None
    got = gemv(x.to(device), w.to(device), b.to(device) if bias else None)
    expected = gemv_ref(x.double(), w.double(), b.double() if bias else None)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.cpu().double(), expected, **tolerances[dtype])


@pytest.mark.parametrize("block_n, block_k", [(16, 16), (32, 64), (64, 128)])
def test_gemv_any_tile_gives_the_same_answer(device, rng, block_n, block_k):
    x, w = torch.randn(2, 100, generator=rng), torch.randn(70, 100, generator=rng)
    got = gemv(x.to(device), w.to(device), block_n=block_n, block_k=block_k)
    torch.testing.assert_close(got.cpu(), gemv_ref(x, w), atol=2e-5, rtol=2e-5)


def test_gemv_strided_rows(device, rng):
    """x as rows of a wider buffer (e.g. the last token of each request)."""
    buffer = torch.randn(4, 80, generator=rng)
    x, w = buffer[::2, :64], torch.randn(32, 64, generator=rng)
    torch.testing.assert_close(gemv(x.to(device), w.to(device)).cpu(), gemv_ref(x, w), atol=2e-5, rtol=2e-5)


def test_gemv_rejects_bad_arguments(device):
    w = torch.zeros(8, 16, device=device)
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv(torch.zeros(MAX_ROWS + 1, 16, device=device), w)
    with pytest.raises(ValueError, match="must be \\[m, k\\]"):
        gemv(torch.zeros(2, 15, device=device), w)
    with pytest.raises(ValueError, match="share a float dtype"):
        gemv(torch.zeros(2, 16, dtype=torch.float16, device=device), w)
    with pytest.raises(ValueError, match="bias must be"):
        gemv(torch.zeros(2, 16, device=device), w, torch.zeros(7, device=device))
    with pytest.raises(ValueError, match="power of two"):
        gemv(torch.zeros(2, 16, device=device), w, block_n=24)
