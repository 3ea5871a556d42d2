"""Rotary position embedding (non-interleaved, HF's rotate_half layout) of q and k together.

For a token at position p and a head vector x = (x1, x2) split in halves,
    out = (x1 cos - x2 sin, x2 cos + x1 sin),   cos/sin = table[p] (float32, [head_dim // 2])
computed in float32 and cast back to x's dtype.
"""
from __future__ import annotations

import torch


def apply_rotary_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens]
    cos: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin: torch.Tensor,  # [max_positions, head_dim // 2] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    c = cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim // 2]
    s = sin[positions].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def apply_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens]
    cos: torch.Tensor,  # [max_positions, head_dim // 2] float32
    sin: torch.Tensor,  # [max_positions, head_dim // 2] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel, same contract as `apply_rotary_ref` (kernels/rotary_triton.py): one launch
    for q and k. Triton is imported on first use."""
    from kernels.rotary_triton import apply_rotary as apply_rotary_triton

    return apply_rotary_triton(q, k, positions, cos, sin)
