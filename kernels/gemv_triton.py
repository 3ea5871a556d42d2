"""Small-batch matmul as a Triton kernel; `gemv_ref` in gemv.py is its reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv import MAX_ROWS
from kernels.launch import FLOAT_DTYPES, check_device, check_last_dim_contiguous, dot_config


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    # program p computes out[:, p * BLOCK_N : (p + 1) * BLOCK_N], reading its BLOCK_N weight rows
    # once, BLOCK_K columns at a time; x (at most BLOCK_M rows, padded for tl.dot) is re-read from cache
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_mask = n < N
    m_mask = m < M
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def default_tiles(dtype: torch.dtype) -> tuple[int, int]:
    """(block_n, block_k): 16 weight rows per program, so that even a 2048-row weight gives 128
    programs (an H200 has 132 SMs), and 512-byte row segments per load."""
    return 16, 512 // dtype.itemsize


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """x: [m, k] with m <= MAX_ROWS, weight: [n, k], bias: [n] or None -> [m, n] in x's dtype."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    check_device(_gemv_kernel, *tensors)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [m, k] and weight [n, k], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"x may have at most {MAX_ROWS} rows, got {x.shape[0]}")
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a float dtype, got {x.dtype} and {weight.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    (m, k), n = x.shape, weight.shape[0]
    tiles = default_tiles(x.dtype)
    block_n, block_k = block_n or tiles[0], block_k or tiles[1]
    for name, size in (("block_n", block_n), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x, weight, bias if bias is not None else x, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=4, num_stages=4, **dot_config(x.dtype, _gemv_kernel),
        )
    return out
