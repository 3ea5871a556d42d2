"""silu(gate) * up as a Triton kernel; `silu_mul_ref` in silu_mul.py is its reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve_kernels.launch import FLOAT_DTYPES, check_device, check_last_dim_contiguous

BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    # program (row, block) writes BLOCK columns of one token's silu(gate) * up
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)  # rounded where torch rounds
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * inter], gate columns then up columns -> [num_tokens, inter], new tensor."""
    check_device(_silu_mul_kernel, x)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [num_tokens, 2 * intermediate_size], got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")
    check_last_dim_contiguous("x", x)
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    if x.shape[0] and inter:
        _silu_mul_kernel[(x.shape[0], triton.cdiv(inter, BLOCK))](
            x, out, x.stride(0), out.stride(0), inter, BLOCK=BLOCK, num_warps=4,
        )
    return out
