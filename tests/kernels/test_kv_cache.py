"""The reference KV-cache store (the fused kernel is tested against it in test_rotary.py)."""
from __future__ import annotations

import torch

from specserve_kernels.kv_cache import PAD_SLOT, store_kvcache_ref


def test_store_kvcache_ref_stores_each_token_at_its_slot_and_skips_padding():
    num_blocks, block_size, num_kv_heads, head_dim = 3, 4, 2, 8
    key = torch.arange(5 * num_kv_heads * head_dim, dtype=torch.float32).view(5, num_kv_heads, head_dim)
    value = -key
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([9, PAD_SLOT, 0, 5, PAD_SLOT])
    store_kvcache_ref(key, value, k_cache, v_cache, slots)
    k_slots, v_slots = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    for token, slot in ((0, 9), (2, 0), (3, 5)):
        assert torch.equal(k_slots[slot], key[token].bfloat16())
        assert torch.equal(v_slots[slot], value[token].bfloat16())
    written = {9, 0, 5}
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert not k_slots[untouched].any() and not v_slots[untouched].any()


def test_store_kvcache_ref_without_padding_is_one_copy():
    k_cache, v_cache = torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4)
    key = torch.randn(4, 1, 4)
    store_kvcache_ref(key, key * 2, k_cache, v_cache, torch.tensor([3, 2, 1, 0]))
    assert torch.equal(k_cache.view(4, 1, 4), key.flip(0))
    assert torch.equal(v_cache.view(4, 1, 4), 2 * key.flip(0))
