"""RoPE of q and k in one launch, and RoPE with the KV-cache store in one launch; `apply_rotary_ref`
and `rotary_store_kv_ref` in rotary.py are their references."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve_kernels.kv_cache import PAD_SLOT
from specserve_kernels.launch import FLOAT_DTYPES, MAX_HEAD_DIM, check_device, check_index, check_kv_cache, check_last_dim_contiguous


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
def _angles(positions_ptr, cos_ptr, sin_ptr, token, stride_cos, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """cos and sin of the token's position, as [1, BLOCK_HALF] rows."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0)[None, :]
    return c, s


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, cos_ptr, sin_ptr, slot_mapping_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh, stride_cos,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    num_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAD: tl.constexpr,
):
    # program `token` rotates the token's q heads into q_out, and its k heads straight into the
    # K cache at the token's slot, where it also copies the v heads
    token = tl.program_id(0).to(tl.int64)
    c, s = _angles(positions_ptr, cos_ptr, sin_ptr, token, stride_cos, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, num_heads, c, s,
                  BLOCK_HQ, HALF, BLOCK_HALF)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot != PAD:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        k_slot = k_cache_ptr + block * stride_kcb + offset * stride_kco
        _rotate_heads(k_ptr, k_slot, token, stride_kt, stride_kh, 0, stride_kch, num_kv_heads, c, s,
                      BLOCK_HK, HALF, BLOCK_HALF)
        h = tl.arange(0, BLOCK_HK)
        dv = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < num_kv_heads) & (dv[None, :] < HEAD_DIM)
        v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + dv[None, :], mask=mask)
        v_slot = v_cache_ptr + block * stride_vcb + offset * stride_vco
        tl.store(v_slot + h[:, None] * stride_vch + dv[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_rotary(q, k, positions, cos, sin) -> None:
    check_index("positions", positions, 1)
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be [num_tokens, heads, head_dim], got {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be one of {FLOAT_DTYPES}, got {t.dtype}")
        check_last_dim_contiguous(name, t)
    num_tokens, _, head_dim = q.shape
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


def _head_blocks(num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    half = head_dim // 2
    return dict(HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
                BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads))


def rotary_store_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int32/int64
    cos: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin: torch.Tensor,  # [max_positions, head_dim // 2] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, PAD_SLOT to skip
) -> torch.Tensor:
    """The rotated q (contiguous); the rotated k and v are written to the caches at their slots,
    cast to the cache dtype. q, k, v may be strided views of one packed QKV projection."""
    check_device(_rotary_store_kv_kernel, q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
    _check_rotary(q, k, positions, cos, sin)
    check_kv_cache(k_cache, v_cache)
    check_index("slot_mapping", slot_mapping, 1)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if v.shape != k.shape or v.dtype not in FLOAT_DTYPES:
        raise ValueError(f"v must have k's shape {tuple(k.shape)} and a float dtype, got {tuple(v.shape)} {v.dtype}")
    check_last_dim_contiguous("v", v)
    if (k.shape[1], head_dim) != (num_kv_heads, cache_head_dim):
        raise ValueError(f"k and v must be [num_tokens, {num_kv_heads}, {cache_head_dim}] to match the cache, "
                         f"got {tuple(k.shape)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must have one entry per token ({num_tokens}), got {slot_mapping.shape[0]}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens:
        _rotary_store_kv_kernel[(num_tokens,)](
            q, k, v, q_out, k_cache, v_cache, positions, cos, sin, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            num_heads, num_kv_heads, **_head_blocks(num_heads, num_kv_heads, head_dim),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, PAD=PAD_SLOT,
        )
    return q_out
