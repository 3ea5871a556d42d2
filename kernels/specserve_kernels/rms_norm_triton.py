"""RMSNorm (+ residual add) as a Triton kernel; `rms_norm_ref` in rms_norm.py is its reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve_kernels.launch import FLOAT_DTYPES, check_device, check_last_dim_contiguous

MAX_HIDDEN = 65536  # one program holds a whole row


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    # program `row` normalises one token: r = x (+ residual); out = weight * (r / rms(r))
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    # arithmetic in float32, rounded to x's dtype where torch rounds (16-bit math in the
    # interpreter would run on raw bits)
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (h + r).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
        h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    normed = (h * inv_rms).to(x_ptr.dtype.element_ty)  # cast back before the weight, as HF does
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x), or (norm(x + residual), x + residual), in new tensors. The output has the dtype
    torch gives `weight * x` (the weight's, when it is wider)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    check_device(_rms_norm_kernel, *tensors)
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got {tuple(x.shape)}")
    hidden = x.shape[1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is above the supported {MAX_HIDDEN}")
    for name, t in zip(("x", "weight", "residual"), tensors):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be one of {FLOAT_DTYPES}, got {t.dtype}")
        check_last_dim_contiguous(name, t)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
        )
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else out
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, residual if residual is not None else x, weight, out, residual_out,
            x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0), residual_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
            num_warps=4 if hidden <= 4096 else 8,
        )
    return out if residual is None else (out, residual_out)
