"""KV-cache write as a Triton kernel; `store_kvcache_ref` in kv_cache.py is its reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import FLOAT_DTYPES, check_device, check_index, check_kv_cache, check_last_dim_contiguous
from kernels.kv_cache import PAD_SLOT

_MAX_TILE = 4096  # elements of K (and of V) one program moves


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAD: tl.constexpr,
):
    # program (token, head tile) copies key/value[token, heads, :] to the caches at slot_mapping[token]
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot == PAD:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD_DIM)
    src = token.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :]
    dst = block * stride_kcb + offset * stride_kco + h[:, None] * stride_kch + d[None, :]
    k = tl.load(key_ptr + src, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    src = token.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :]
    dst = block * stride_vcb + offset * stride_vco + h[:, None] * stride_vch + d[None, :]
    v = tl.load(value_ptr + src, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, PAD_SLOT to skip
) -> None:
    """Writes key/value[t] to slot slot_mapping[t] (= block * block_size + offset) of the caches,
    cast to the cache dtype; PAD_SLOT entries are skipped. key/value may be strided views (e.g. of a
    fused QKV output), and the caches views (e.g. of one [num_blocks, 2, ...] pool), as long as
    head_dim is contiguous."""
    check_device(_store_kvcache_kernel, key, value, k_cache, v_cache, slot_mapping)
    check_kv_cache(k_cache, v_cache)
    check_index("slot_mapping", slot_mapping, 1)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, got {tuple(t.shape)}"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be one of {FLOAT_DTYPES}, got {t.dtype}")
        check_last_dim_contiguous(name, t)
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"key, value and slot_mapping must have one row per token, got "
            f"{key.shape[0]}, {value.shape[0]}, {slot_mapping.shape[0]}"
        )
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kvcache_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, PAD=PAD_SLOT,
    )
