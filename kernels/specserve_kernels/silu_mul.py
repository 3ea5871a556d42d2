"""SwiGLU's activation on the packed gate/up projection, as every Llama MLP runs it:

    out = silu(gate) * up,   [gate | up] = x  (the two halves of the packed gate_up output)

silu is computed in float32 and rounded to the activations' dtype before the multiply, as torch
does for F.silu(gate) * up in 16-bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, 2 * inter] -> [num_tokens, inter]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton kernel, same contract as `silu_mul_ref` (kernels/specserve_kernels/silu_mul_triton.py): one pass that
    reads gate and up and writes the product, instead of two torch kernels and a temporary.
    Triton is imported on first use."""
    from specserve_kernels.silu_mul_triton import silu_mul as silu_mul_triton

    return silu_mul_triton(x)
