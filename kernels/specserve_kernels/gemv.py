"""Small-batch matmul: y = x @ weight.T + bias for a few rows of x (decode at batch 1-16).

With one to a few rows, a linear layer is a matrix-vector product bound by reading the weight:
each weight row is read once, and the few rows of x ride along. cuBLAS picks kernels for
larger shapes and reaches well below the bandwidth on small ones (a 2048 x 3072 qkv projection
at batch 1 ran at 1.8 TB/s on an H200, 42% of the ceiling); `gemv` streams the weight in row
tiles instead. The engine times both per weight shape at startup on CUDA and keeps the faster
(backend/model/linear_tuner.py).

With FP8 weights (`quantization="fp8"`, backend/model/quantized_linear.py) the weight is
float8_e4m3fn with one float32 scale per output row, and each row of x is quantized to FP8 with
its own scale (its absolute maximum / 448) before the product, as torch's `_scaled_mm` takes it
for larger batches: `gemv_fp8_ref` is that product, `gemv(..., weight_scale=...)` the kernel's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve_kernels.gemv_limits import FP8, FP8_MAX, FP8_MIN_AMAX, MAX_ROWS


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)  # x: [m, k], weight: [n, k], bias: [n] -> [m, n]


def fp8_scales(t: torch.Tensor) -> torch.Tensor:
    """Per row of t [rows, k], the float32 scale that maps its absolute maximum to FP8_MAX: [rows]."""
    return t.abs().amax(dim=1).float().clamp(min=FP8_MIN_AMAX) / FP8_MAX


def to_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t [rows, k] divided by its row scales [rows], in float8_e4m3fn."""
    return (t.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def gemv_fp8_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] (float) times an FP8 weight [n, k] with row scales [n]: x's rows quantized to FP8,
    the FP8 products summed in float32 and scaled by both rows' scales, in x's dtype."""
    x_scale = fp8_scales(x)
    y = (to_fp8(x, x_scale).float() @ weight.float().t()) * x_scale[:, None] * weight_scale.float()[None, :]
    return (y if bias is None else y + bias.float()).to(x.dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         block_n: int | None = None, block_k: int | None = None,
         weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton kernel, same contract as `gemv_ref` for at most MAX_ROWS rows of x, or as
    `gemv_fp8_ref` for an FP8 weight with its `weight_scale` (kernels/specserve_kernels/gemv_triton.py); block_n /
    block_k override the tile (benchmarks try others). Triton is imported on first use."""
    from specserve_kernels.gemv_triton import gemv as gemv_triton

    return gemv_triton(x, weight, bias, block_n, block_k, weight_scale)
