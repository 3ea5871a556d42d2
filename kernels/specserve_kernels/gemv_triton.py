"""Small-batch matmul as a Triton kernel; `gemv_ref` and `gemv_fp8_ref` in gemv.py are its references."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve_kernels.gemv_limits import FP8, FP8_MAX, FP8_MIN_AMAX, MAX_ROWS
from specserve_kernels.launch import FLOAT_DTYPES, check_device, check_last_dim_contiguous, dot_config, interpreted

INTERPRETED_MAX_TILE = 1024

_FP8_MAX = tl.constexpr(FP8_MAX)  # (a jit'd function reads globals only as constexprs)
_FP8_MIN_AMAX = tl.constexpr(FP8_MIN_AMAX)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, w_scale_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, FP8_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    # program p computes out[:, p * BLOCK_N : (p + 1) * BLOCK_N], reading its BLOCK_N weight rows
    # once, BLOCK_K columns at a time; x (at most BLOCK_M rows, padded for tl.dot) is re-read from cache
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_mask = n < N
    m_mask = m < M
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + m[:, None] * stride_xm
    if FP8_WEIGHT:  # x's row scales first: each row's absolute maximum over all of K
        amax = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        x_scale = tl.maximum(amax, _FP8_MIN_AMAX) / _FP8_MAX
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if FP8_WEIGHT:  # x's FP8 values, exact in DOT_DTYPE as the weight's are
            x = tl.clamp(x.to(tl.float32) / x_scale[:, None], -_FP8_MAX, _FP8_MAX)
            x = x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=PRECISION)
    if FP8_WEIGHT:
        acc *= x_scale[:, None] * tl.load(w_scale_ptr + n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def default_tiles(dtype: torch.dtype) -> tuple[int, int]:
    """(block_n, block_k): 16 weight rows per program, so that even a 2048-row weight gives 128
    programs (an H200 has 132 SMs), and 512-byte row segments per load."""
    return 16, 512 // dtype.itemsize


def interpreted_tiles(n: int, k: int) -> tuple[int, int]:
    """(block_n, block_k) under the interpreter, which runs each program in turn in numpy: one tile
    as large as the weight (up to INTERPRETED_MAX_TILE a side) is 10-25x faster than the GPU's."""
    return tuple(min(max(16, 1 << (size - 1).bit_length()), INTERPRETED_MAX_TILE) for size in (n, k))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         block_n: int | None = None, block_k: int | None = None,
         weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x: [m, k] with m <= MAX_ROWS, weight: [n, k] (x's dtype, or FP8 with weight_scale [n]
    float32), bias: [n] or None -> [m, n] in x's dtype."""
    tensors = [t for t in (x, weight, bias, weight_scale) if t is not None]
    check_device(_gemv_kernel, *tensors)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [m, k] and weight [n, k], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"x may have at most {MAX_ROWS} rows, got {x.shape[0]}")
    fp8 = weight.dtype == FP8
    if x.dtype not in FLOAT_DTYPES or (weight.dtype != x.dtype and not fp8):
        raise ValueError(f"x and weight must share a float dtype (or the weight be {FP8}), got {x.dtype} and "
                         f"{weight.dtype}")
    if fp8 != (weight_scale is not None):
        raise ValueError("weight_scale goes with an FP8 weight, and only with one")
    if fp8 and (weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32):
        raise ValueError(f"weight_scale must be [{weight.shape[0]}] float32, got {tuple(weight_scale.shape)} "
                         f"{weight_scale.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    (m, k), n = x.shape, weight.shape[0]
    tiles = interpreted_tiles(n, k) if interpreted(_gemv_kernel) else default_tiles(weight.dtype)
    block_n, block_k = block_n or tiles[0], block_k or tiles[1]
    for name, size in (("block_n", block_n), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        # FP8 values are exact in bfloat16: its dot multiplies them exactly, in float32
        dots = dot_config(torch.bfloat16 if fp8 else x.dtype, _gemv_kernel)
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x, weight, bias if bias is not None else x, weight_scale if fp8 else x, out,
            m, n, k, x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, FP8_WEIGHT=fp8, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=4, num_stages=4, **dots,
        )
    return out
