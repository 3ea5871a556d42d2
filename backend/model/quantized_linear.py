"""Weight-only quantized linear layers, made at load from a model's float weights.

A decode step at small batch reads every weight once for a few rows of output, so its time is the
weights' bytes over the memory bandwidth; fewer bytes per weight is the whole gain.

    int8   w = q * scale[n]                       q in [-127, 127], one scale per output row
    int4   w = q * scale[n, g] + minimum[n, g]    q in [0, 15], per group of `group_size` inputs

int4 is asymmetric with a group's minimum and (maximum - minimum) / 15 as its step, GGUF's Q4_1
layout: weights dequantized from Q4_1 blocks of 32 (the default model's) come back exactly at
group size 32, up to the bfloat16 rounding of each group's step and minimum.

On a CPU the products run in torch's packed weight-only kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`). They are fast with bfloat16 activations only (their float32 and
float16 paths run 10-30x slower), so a layer casts its input to bfloat16 for the product and the
result back: the residual stream, norms, RoPE and attention keep the model's dtype. On other
devices a layer multiplies by its dequantized weight (correct, no faster than the float model).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.config import check_quantization
from backend.errors import ValidationError
from backend.model.model import Linear
from backend.model.tensor_parallel import ParallelLMHead

KERNEL_DTYPE = torch.bfloat16  # the packed CPU kernels' activations, scales and output
INT4_ROWS = 16  # the packed int4 layout holds output rows in multiples of this (padded with zeros)


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(KERNEL_DTYPE))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] float32
        return self.qweight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.qweight.device.type == "cpu":  # the kernel takes 2-D input
            y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE), self.qweight, self.scale)
            y = y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        else:
            y = F.linear(x, (self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]))
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int):
        super().__init__()
        out_features, in_features = weight.shape
        if in_features % group_size:
            raise ValidationError("quantization_group_size", f"must divide every layer's input width; "
                                  f"{group_size} does not divide {in_features}")
        self.out_features, self.group_size = out_features, group_size
        rows = -(-out_features // INT4_ROWS) * INT4_ROWS
        w = weight.detach().float().new_zeros(rows, in_features)
        w[:out_features] = weight.detach().float()
        groups = w.view(rows, in_features // group_size, group_size)
        minimum, maximum = groups.amin(dim=-1), groups.amax(dim=-1)
        step = ((maximum - minimum) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        # the kernel's convention: w = (q - 8) * scale + zero, so zero = minimum + 8 * scale; the codes
        # are rounded against the scale and zero as the kernel reads them (bfloat16)
        scale = step.to(KERNEL_DTYPE).float()
        zero = (minimum + 8 * step).to(KERNEL_DTYPE).float()
        codes = ((groups - (zero - 8 * scale)[..., None]) / scale[..., None]).round().clamp(0, 15)
        codes = codes.view(rows, in_features)
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1)  # [groups, rows, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(KERNEL_DTYPE).contiguous())
        self.packed = weight.device.type == "cpu"  # else one uint8 code per weight, dequantized per call
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
                             if self.packed else codes.to(torch.uint8))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def codes(self) -> torch.Tensor:  # [rows, in] the 4-bit codes, as float32
        if not self.packed:
            return self.qweight.float()
        # read back through the kernel: the identity times the weight with scale 1 and zero 8
        eye = torch.eye(self.qweight.shape[1] * 2, dtype=KERNEL_DTYPE)
        unit = torch.tensor([1.0, 8.0], dtype=KERNEL_DTYPE).expand_as(self.scales_and_zeros).contiguous()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, unit).t().float()

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] float32
        codes = self.codes()
        rows, in_features = codes.shape
        scale, zero = self.scales_and_zeros.float().unbind(-1)  # [groups, rows]
        groups = codes.view(rows, in_features // self.group_size, self.group_size)
        w = (groups - 8) * scale.t()[..., None] + zero.t()[..., None]
        return w.view(rows, in_features)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.packed:  # the kernel takes 2-D input
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE), self.qweight,
                                                           self.group_size, self.scales_and_zeros)
            y = y[:, : self.out_features].reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        else:
            y = F.linear(x, self.dequantized_weight().to(x.dtype))
        return y if self.bias is None else y + self.bias


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, mode: str, group_size: int = 32) -> nn.Module:
    """The quantized form of y = x @ weight.T + bias ("int8" or "int4")."""
    return Int8Linear(weight, bias) if mode == "int8" else Int4Linear(weight, bias, group_size)


def quantize_linears(model: nn.Module, mode: str, group_size: int = 32) -> int:
    """Quantizes every linear layer of the model (backend/model/model.py's Linear, including the
    tensor-parallel ones, and the lm_head; a tied lm_head gets a quantized copy while the
    embedding table stays as it is: a lookup reads one row per token). Each keeps its own forward
    (a row-parallel layer still all-reduces) and multiplies through its `quantized` layer; its float
    weight is dropped. Returns the bytes of quantized weight ("none": leaves the model, 0)."""
    check_quantization(mode, group_size)
    if mode == "none":
        return 0
    total = 0
    for module in model.modules():
        if isinstance(module, (Linear, ParallelLMHead)) and module.quantized is None:
            bias = getattr(module, "bias", None)
            module.quantized = quantized_linear(module.weight, bias, mode, group_size)
            module.weight = None
            if bias is not None:
                module.bias = None
            total += sum(b.numel() * b.element_size() for b in module.quantized.buffers())
    return total


def swap_linears(model: nn.Module, mode: str, group_size: int = 32) -> nn.Module:
    """Replaces every torch nn.Linear of a model from elsewhere (HF transformers', for the tests
    and benchmarks that compare against it) by its quantized form; returns the model."""
    check_quantization(mode, group_size)
    if mode != "none":
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, quantized_linear(child.weight, child.bias, mode, group_size))
    return model
