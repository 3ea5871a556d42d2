"""Small-batch matmul: y = x @ weight.T + bias for a few rows of x (decode at batch 1-16).

With one to a few rows, a linear layer is a matrix-vector product bound by reading the weight:
each weight row is read once, and the few rows of x ride along. cuBLAS picks kernels for
larger shapes and reaches well below the bandwidth on small ones (a 2048 x 3072 qkv projection
at batch 1 ran at 1.8 TB/s on an H200, 42% of the ceiling); `gemv` streams the weight in row
tiles instead. The engine times both per weight shape at startup on CUDA and keeps the faster
(backend/model/linear_tuner.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 16  # rows of x one launch takes (tl.dot's minimum tile height)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)  # x: [m, k], weight: [n, k], bias: [n] -> [m, n]


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """Triton kernel, same contract as `gemv_ref` for at most MAX_ROWS rows of x
    (kernels/gemv_triton.py); block_n / block_k override the tile (benchmarks try others).
    Triton is imported on first use."""
    from kernels.gemv_triton import gemv as gemv_triton

    return gemv_triton(x, weight, bias, block_n, block_k)
