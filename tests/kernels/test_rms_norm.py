from __future__ import annotations

import pytest
import torch

from specserve_kernels.rms_norm import rms_norm, rms_norm_ref


@pytest.mark.parametrize(
    "num_tokens, hidden, dtype, with_residual",
    [
        (7, 384, torch.float32, True),
        (5, 128, torch.float32, False),
        (9, 2048, torch.bfloat16, True),
        (3, 96, torch.float16, True),  # hidden not a power of two
        (0, 64, torch.float32, True),  # an empty step
    ],
)
def test_rms_norm_matches_reference(device, rng, tolerances, num_tokens, hidden, dtype, with_residual):
    x = torch.randn(num_tokens, hidden, generator=rng).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=rng)).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=rng).to(dtype) if with_residual else None
    expected = rms_norm_ref(x.double(), weight.double(), 1e-5, None if residual is None else residual.double())
    got = rms_norm(x.to(device), weight.to(device), 1e-5, None if residual is None else residual.to(device))
    if not with_residual:
        expected, got = (expected,), (got,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == dtype and g.shape == e.shape
        torch.testing.assert_close(g.cpu().double(), e, **tolerances[dtype])


def test_rms_norm_strided_rows(device, rng):
    """Rows of a wider buffer (e.g. the logits rows picked from a step's hidden states)."""
    buffer = torch.randn(6, 512, generator=rng)
    x = buffer[::2, :256]
    weight = torch.randn(256, generator=rng)
    torch.testing.assert_close(rms_norm(x.to(device), weight.to(device), 1e-6).cpu(), rms_norm_ref(x, weight, 1e-6))


def test_rms_norm_rejects_bad_arguments(device):
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(4, device=device), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8, device=device), 1e-5, torch.zeros(2, 8, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.zeros(8, 2, device=device).t(), torch.ones(8, device=device), 1e-5)
