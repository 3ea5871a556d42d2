from __future__ import annotations

import pytest
import torch

from kernels.kv_cache import PAD_SLOT, store_kvcache, store_kvcache_ref


def _slots(rng: torch.Generator, num_tokens: int, num_blocks: int, block_size: int) -> torch.Tensor:
    """Distinct random slots, every third one padding."""
    slots = torch.randperm(num_blocks * block_size, generator=rng)[:num_tokens]
    slots[::3] = PAD_SLOT
    return slots


@pytest.mark.parametrize(
    "block_size, num_kv_heads, head_dim, src_dtype, cache_dtype",
    [
        (8, 2, 64, torch.float32, torch.float32),
        (16, 8, 128, torch.bfloat16, torch.bfloat16),
        (32, 1, 128, torch.float16, torch.float16),
        (64, 4, 32, torch.float32, torch.bfloat16),  # cast on store
        (128, 2, 80, torch.float16, torch.float32),  # head_dim not a power of two
    ],
)
def test_store_kvcache_matches_reference(
    device, rng, interpret, block_size, num_kv_heads, head_dim, src_dtype, cache_dtype
):
    num_tokens, num_blocks = 13, 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=rng).to(cache_dtype).to(device)
    v_cache = torch.randn(shape, generator=rng).to(cache_dtype).to(device)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=rng).to(src_dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=rng).to(src_dtype).to(device)
    slot_mapping = _slots(rng, num_tokens, num_blocks, block_size).to(device)
    k_ref, v_ref, k_before = k_cache.clone(), v_cache.clone(), k_cache.clone()

    store_kvcache_ref(key, value, k_ref, v_ref, slot_mapping)
    store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    # a copy is exact; a float32 -> bfloat16 cast rounds to nearest even on the GPU but truncates
    # under the interpreter, one bfloat16 ulp at most
    truncating = interpret and (src_dtype, cache_dtype) == (torch.float32, torch.bfloat16)
    tol = dict(atol=0.0, rtol=2**-7 if truncating else 0.0)
    torch.testing.assert_close(k_cache, k_ref, **tol)
    torch.testing.assert_close(v_cache, v_ref, **tol)
    assert not torch.equal(k_cache, k_before)


def test_store_kvcache_strided_views(device, rng):
    """key/value sliced from a fused QKV output, caches as views of one [blocks, 2, ...] pool,
    int32 slots."""
    num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 8, 2, 64, 16, 4
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=rng).to(device)
    key, value = qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    pool = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_dim, device=device)
    slot_mapping = _slots(rng, num_tokens, num_blocks, block_size).to(torch.int32).to(device)
    k_ref = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=device)
    v_ref = torch.zeros_like(k_ref)

    store_kvcache_ref(key, value, k_ref, v_ref, slot_mapping.long())
    store_kvcache(key, value, pool[:, 0], pool[:, 1], slot_mapping)

    assert torch.equal(pool[:, 0], k_ref)
    assert torch.equal(pool[:, 1], v_ref)


def test_store_kvcache_rejects_bad_arguments(device):
    cache = torch.zeros(2, 8, 2, 64, device=device)
    key = torch.zeros(3, 2, 64, device=device)
    slots = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        store_kvcache(key, key, cache, cache.clone(), slots.float())
    with pytest.raises(ValueError, match=r"key must be \[num_tokens, 2, 64\]"):
        store_kvcache(key[:, :1], key, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="value must be contiguous in its last dim"):
        store_kvcache(key, torch.zeros(3, 2, 128, device=device)[..., ::2], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="one row per token"):
        store_kvcache(key, key, cache, cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="must match"):
        store_kvcache(key, key, cache, cache.half(), slots)
