"""KV-cache write: store the step's K and V at their slots.

Cache layout (backend/model/model_runner.py): per layer `[num_blocks, block_size, num_kv_heads, head_dim]`;
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
    k_slots, v_slots = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    if slot_mapping.numel() and int(slot_mapping.min()) != PAD_SLOT:  # no padding: one copy each
        k_slots.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_slots.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
        return
    valid = slot_mapping != PAD_SLOT
    slots = slot_mapping[valid]
    k_slots[slots] = key[valid].to(k_cache.dtype)
    v_slots[slots] = value[valid].to(v_cache.dtype)
