"""Rotary position embedding (non-interleaved, HF's rotate_half layout) of q and k together.

For a token at position p and a head vector x = (x1, x2) split in halves,
    out = (x1 cos - x2 sin, x2 cos + x1 sin),   cos/sin = table[p] (float32, [head_dim // 2])
computed in float32 and cast back to x's dtype.

`rotary_store_kv` does what every attention layer does next as well: it stores the rotated k and
v at their KV-cache slots (kv_cache.py) and returns only the rotated q.
"""
from __future__ import annotations

import torch

from specserve_kernels.kv_cache import store_kvcache_ref


def rotary_tables(
    positions: torch.Tensor,  # [num_tokens]
    cos: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin: torch.Tensor,  # [max_positions, head_dim // 2] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's rotation as two [num_tokens, 1, head_dim] float32 factors (cos, cos) and
    (-sin, sin): every layer of a step rotates by the same ones (see `rotate`)."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return torch.cat((c, c), dim=-1), torch.cat((-s, s), dim=-1)


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [num_tokens, heads, head_dim] rotated: x * (cos, cos) + (x2, x1) * (-sin, sin), the same
    products and sums as (x1 cos - x2 sin, x2 cos + x1 sin) and as HF's x * cos + rotate_half(x)
    * sin (no fused multiply-add, which would round differently)."""
    c, s = tables
    h = x.float()
    return (h * c + h.roll(x.shape[-1] // 2, dims=-1) * s).to(x.dtype)


def apply_rotary_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens]
    cos: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin: torch.Tensor,  # [max_positions, head_dim // 2] float32
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,  # rotary_tables(positions, cos, sin), when shared
) -> tuple[torch.Tensor, torch.Tensor]:
    tables = tables or rotary_tables(positions, cos, sin)
    return rotate(q, tables), rotate(k, tables)


def rotary_store_kv_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens]
    cos: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin: torch.Tensor,  # [max_positions, head_dim // 2] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], PAD_SLOT to skip
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,  # rotary_tables(positions, cos, sin), when shared
) -> torch.Tensor:  # rotated q
    q, k = apply_rotary_ref(q, k, positions, cos, sin, tables)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def rotary_store_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens]
    cos: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin: torch.Tensor,  # [max_positions, head_dim // 2] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], PAD_SLOT to skip
) -> torch.Tensor:  # rotated q
    """Triton kernel, same contract as `rotary_store_kv_ref` (kernels/specserve_kernels/rotary_triton.py): one
    launch instead of two, and the rotated k goes to the cache without a round trip through memory."""
    from specserve_kernels.rotary_triton import rotary_store_kv as rotary_store_kv_triton

    return rotary_store_kv_triton(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
