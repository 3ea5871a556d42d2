"""KV-cache write: store the step's K and V at their slots.

Cache layout (DESIGN.md): per layer `[num_blocks, block_size, num_kv_heads, head_dim]`;
slot = block_id * block_size + offset. A slot of PAD_SLOT (-1) is skipped.
"""
from __future__ import annotations

import torch

PAD_SLOT = -1


def store_kvcache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, PAD_SLOT to skip
) -> None:
    valid = slot_mapping != PAD_SLOT
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[valid].to(v_cache.dtype)


def store_kvcache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, PAD_SLOT to skip
) -> None:
    """Triton kernel, same contract as `store_kvcache_ref` (kernels/kv_cache_triton.py). Triton is
    imported here, on first use, so the reference stays importable where it is not installed."""
    from kernels.kv_cache_triton import store_kvcache as store_kvcache_triton

    store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping)
