"""RoPE of q and k in one launch; `apply_rotary_ref` in rotary.py is its reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import FLOAT_DTYPES, MAX_HEAD_DIM, check_device, check_index, check_last_dim_contiguous


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, stride_st, stride_sh, stride_dt, stride_dh, num_heads, c, s,
                  BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < num_heads) & (d[None, :] < HALF)
    src = src_ptr + token * stride_st + h[:, None] * stride_sh + d[None, :]
    dst = dst_ptr + token * stride_dt + h[:, None] * stride_dh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * c - x2 * s).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos,
    num_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    # program `token` rotates every q and k head of one token by its position's angles
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, num_heads, c, s,
                  BLOCK_HQ, HALF, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, num_kv_heads, c, s,
                  BLOCK_HK, HALF, BLOCK_HALF)


def apply_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int32/int64
    cos: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin: torch.Tensor,  # [max_positions, head_dim // 2] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and k (contiguous). q and k may be strided views, e.g. of one packed
    QKV projection, as long as head_dim is contiguous. Positions must be < max_positions."""
    check_device(_rotary_kernel, q, k, positions, cos, sin)
    check_index("positions", positions, 1)
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be [num_tokens, heads, head_dim], got {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be one of {FLOAT_DTYPES}, got {t.dtype}")
        check_last_dim_contiguous(name, t)
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape[0] != num_tokens:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)} and positions {tuple(positions.shape)} must agree"
        )
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be even and <= {MAX_HEAD_DIM}, got {head_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != head_dim // 2:
            raise ValueError(f"{name} must be float32 [max_positions, {head_dim // 2}], got {t.dtype} {tuple(t.shape)}")
        check_last_dim_contiguous(name, t)
    if sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError("sin must have the shape and strides of cos")
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
            num_heads, k.shape[1],
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        )
    return q_out, k_out
