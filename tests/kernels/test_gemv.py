from __future__ import annotations

import pytest
import torch

from specserve_kernels.gemv import FP8, MAX_ROWS, fp8_scales, gemv, gemv_fp8_ref, gemv_ref, to_fp8


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


@pytest.mark.parametrize("m, n, k, dtype, bias", [
    (1, 96, 384, torch.bfloat16, False),
    (5, 200, 130, torch.float32, True),  # n and k not multiples of a tile
    (MAX_ROWS, 64, 1536, torch.bfloat16, True),  # several k tiles, for the scales and the product
])
def test_gemv_fp8_matches_reference(device, rng, m, n, k, dtype, bias):
    """An FP8 weight with row scales: the kernel quantizes x's rows as the reference does, so the
    two differ only by summation order (and the output's rounding)."""
    x = torch.randn(m, k, generator=rng).to(dtype)
    x[0, 3] = 40.0  # one large activation sets its row's scale
    w = torch.randn(n, k, generator=rng) / k**0.5
    w_scale = fp8_scales(w)
    qw = to_fp8(w, w_scale)
    b = torch.randn(n, generator=rng).to(dtype) if bias else None
    got = gemv(x.to(device), qw.to(device), b.to(device) if bias else None, weight_scale=w_scale.to(device))
    expected = gemv_fp8_ref(x, qw, w_scale, b)
    assert got.dtype == dtype and got.shape == (m, n)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.cpu().float(), expected.float(), atol=tolerance, rtol=tolerance)
    # and the reference is torch's own scaled product
    x_scale = fp8_scales(x)
    scaled = torch._scaled_mm(to_fp8(x, x_scale), qw.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :],
                              out_dtype=torch.float32)
    torch.testing.assert_close(expected.float(), (scaled if b is None else scaled + b.float()).to(dtype).float(),
                               atol=tolerance, rtol=tolerance)


def test_fp8_weight_error_is_small(rng):
    """Row-scaled FP8 keeps a weight within float8_e4m3fn's 3 mantissa bits: each value within
    1/16 of itself (or of the row's smallest normal step near zero)."""
    w = torch.randn(64, 256, generator=rng)
    scale = fp8_scales(w)
    back = to_fp8(w, scale).float() * scale[:, None]
    assert ((back - w).abs() <= w.abs() / 16 + scale[:, None] * 2**-9).all()


def test_gemv_fp8_rejects_bad_scales(device):
    w = torch.zeros(8, 16, device=device).to(FP8)
    x = torch.zeros(2, 16, device=device)
    with pytest.raises(ValueError, match="weight_scale goes with"):
        gemv(x, w)
    with pytest.raises(ValueError, match="weight_scale must be"):
        gemv(x, w, weight_scale=torch.ones(7, device=device))
