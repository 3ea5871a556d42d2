from __future__ import annotations

import pytest
import torch



def _tables(max_positions: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()


def _fused_args(device, num_tokens: int = 3, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64):
    """Arguments of rotary_store_kv: zero q/k/v, 16 positions of tables, a 3-block cache of 8 slots."""
    cos, sin = _tables(16, head_dim)
    cache = torch.zeros(3, 8, num_kv_heads, head_dim)
    q, k, v = (torch.zeros(num_tokens, h, head_dim) for h in (num_heads, num_kv_heads, num_kv_heads))
    return [t.to(device) for t in (q, k, v, torch.zeros(num_tokens, dtype=torch.int64), cos, sin, cache,
                                   cache.clone(), torch.arange(num_tokens, dtype=torch.int64))]


def test_rotary_position_zero_is_identity(device, rng):
    from specserve_kernels.rotary import rotary_store_kv

    args = _fused_args(device)
    q, k = torch.randn(3, 4, 64, generator=rng), torch.randn(3, 2, 64, generator=rng)
    args[0], args[1] = q.to(device), k.to(device)
    q_out = rotary_store_kv(*args)
    torch.testing.assert_close(q_out.cpu(), q)
    torch.testing.assert_close(args[6].cpu().view(-1, 2, 64)[:3], k)  # stored at slots 0, 1, 2


def test_rotary_rejects_bad_tables_and_positions(device):
    from specserve_kernels.rotary import rotary_store_kv

    bad_k = _fused_args(device)
    bad_k[1] = bad_k[1][:1]
    with pytest.raises(ValueError, match="must agree"):
        rotary_store_kv(*bad_k)
    bad_cos = _fused_args(device)
    bad_cos[4] = bad_cos[4].double()
    with pytest.raises(ValueError, match="float32"):
        rotary_store_kv(*bad_cos)
    bad_positions = _fused_args(device)
    bad_positions[3] = bad_positions[3].float()
    with pytest.raises(ValueError, match="int32 or int64"):
        rotary_store_kv(*bad_positions)


@pytest.mark.parametrize(
    "num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype",
    [
        (7, 6, 2, 64, 8, torch.float32),
        (13, 32, 8, 128, 16, torch.bfloat16),
        (5, 12, 2, 80, 32, torch.float16),  # head_dim not a power of two
        (4, 8, 1, 64, 128, torch.float32),  # one KV head
        (0, 4, 2, 64, 16, torch.float32),
    ],
)
def test_rotary_store_kv_matches_rotary_then_store(device, rng, tolerances, num_tokens, num_heads, num_kv_heads,
                                                   head_dim, block_size, dtype):
    """The fused launch returns the reference's rotated q and leaves the caches as
    store_kvcache_ref of the rotated k and of v leaves them (padding slots untouched)."""
    from specserve_kernels.kv_cache import PAD_SLOT
    from specserve_kernels.rotary import rotary_store_kv, rotary_store_kv_ref

    num_blocks = 4
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=rng).to(dtype)
    positions = torch.randint(0, 500, (num_tokens,), generator=rng)
    slots = torch.randperm(num_blocks * block_size, generator=rng)[:num_tokens]
    slots[1::3] = PAD_SLOT
    cos, sin = _tables(512, head_dim)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(cache_shape, generator=rng).to(dtype), torch.randn(cache_shape, generator=rng).to(dtype)

    def split(t):
        return t.split([num_heads, num_kv_heads, num_kv_heads], dim=1)

    k_ref, v_ref = k_cache.double(), v_cache.double()
    q_ref = rotary_store_kv_ref(*split(qkv.double()), positions, cos.double(), sin.double(), k_ref, v_ref, slots)
    k_dev, v_dev = k_cache.clone().to(device), v_cache.clone().to(device)
    q_out = rotary_store_kv(*split(qkv.to(device)), positions.to(device), cos.to(device), sin.to(device),
                            k_dev, v_dev, slots.to(device))
    assert q_out.dtype == dtype and q_out.shape == q_ref.shape
    torch.testing.assert_close(q_out.cpu().double(), q_ref, **tolerances[dtype])
    torch.testing.assert_close(k_dev.cpu().double(), k_ref, **tolerances[dtype])
    torch.testing.assert_close(v_dev.cpu().double(), v_ref, atol=0.0, rtol=0.0)  # v is copied
    if num_tokens:
        assert not torch.equal(k_dev.cpu(), k_cache)  # something was written


def test_rotary_store_kv_checks_its_arguments(device):
    from specserve_kernels.rotary import rotary_store_kv

    cos, sin = _tables(16, 64)
    q, k, v = torch.zeros(2, 4, 64), torch.zeros(2, 2, 64), torch.zeros(2, 2, 64)
    cache = torch.zeros(3, 8, 2, 64)
    args = [t.to(device) for t in (q, k, v, torch.zeros(2, dtype=torch.int64), cos, sin, cache, cache.clone(),
                                   torch.zeros(2, dtype=torch.int64))]
    bad_v = list(args)
    bad_v[2] = torch.zeros(2, 3, 64, device=device)
    with pytest.raises(ValueError, match="v must have k's shape"):
        rotary_store_kv(*bad_v)
    bad_cache = list(args)
    bad_cache[6], bad_cache[7] = torch.zeros(3, 8, 4, 64, device=device), torch.zeros(3, 8, 4, 64, device=device)
    with pytest.raises(ValueError, match="to match the cache"):
        rotary_store_kv(*bad_cache)
    bad_slots = list(args)
    bad_slots[8] = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="slot_mapping must have one entry per token"):
        rotary_store_kv(*bad_slots)
