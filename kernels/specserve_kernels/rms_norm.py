"""RMSNorm with the residual add folded in, as every decoder layer runs it:

    residual' = x + residual           (when a residual is given; in the activations' dtype)
    out       = weight * (r / sqrt(mean(r^2) + eps))   r = residual' (or x), computed in float32,
                                                        cast back before the weight multiply (HF)
"""
from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x), or (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel, same contract as `rms_norm_ref` (kernels/specserve_kernels/rms_norm_triton.py): one pass over
    each row instead of six torch ops. Triton is imported on first use."""
    from specserve_kernels.rms_norm_triton import rms_norm as rms_norm_triton

    return rms_norm_triton(x, weight, eps, residual)
