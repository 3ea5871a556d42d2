"""Quantizing a whole model: every linear layer replaced by its quantized form (quantized_linear.py),
the lm_head's rescored from its float weight.
"""
from __future__ import annotations

import torch
from torch import nn

from backend.config import check_quantization
from backend.model.model import Linear
from backend.model.quantized_linear import Fp8Linear, Int4Linear, Int8Linear, as_rows, unflatten_rows
from backend.model.tensor_parallel import ParallelLMHead


class RescoredHead(nn.Module):
    """An lm_head whose quantized logits choose the candidates and whose float weight scores them:
    each row's `candidates` highest quantized logits are computed again exactly from the float
    weight (the embedding table when the head is tied: no copy), so greedy decoding and the top of
    every distribution carry no quantization error, at the cost of reading `candidates` rows."""

    def __init__(self, quantized: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, candidates: int):
        super().__init__()
        self.quantized, self.candidates = quantized, candidates
        self.exact_weight = weight.detach()  # a plain tensor: not a parameter, read a few rows a step
        self.exact_bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        flat = as_rows(x)
        logits = self.quantized(flat)
        rows = logits.topk(min(self.candidates, logits.shape[-1]), dim=-1).indices  # [n, candidates]
        exact = torch.bmm(self.exact_weight[rows], flat.to(self.exact_weight.dtype).unsqueeze(-1)).squeeze(-1)
        if self.exact_bias is not None:
            exact = exact + self.exact_bias[rows]
        return unflatten_rows(logits.scatter(-1, rows, exact.to(logits.dtype)), x)


HEAD_CANDIDATES = 32


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, mode: str, group_size: int = 32,
                     lm_head: bool = False) -> nn.Module:
    """The quantized form of y = x @ weight.T + bias ("int8", "int4" or "fp8"); an lm_head's is a
    RescoredHead over it (not made for fp8, whose lm_head stays as it is)."""
    if mode == "fp8":
        return Fp8Linear(weight, bias)
    layer = Int8Linear(weight, bias) if mode == "int8" else Int4Linear(weight, bias, group_size)
    return RescoredHead(layer, weight, bias, HEAD_CANDIDATES) if lm_head else layer


def quantize_linears(model: nn.Module, mode: str, group_size: int = 32) -> int:
    """Quantizes every linear layer of the model (backend/model/model.py's Linear, including the
    tensor-parallel ones, and the lm_head, rescored from its float weight, which it keeps: a tied
    one shares it with the embedding table, which stays as it is). Each keeps its own forward
    (a row-parallel layer still all-reduces) and multiplies through its `quantized` layer; its float
    weight is dropped. Returns the bytes of quantized weight ("none": leaves the model, 0).
    fp8 leaves the lm_head as it is."""
    check_quantization(mode, group_size)
    if mode == "none":
        return 0
    total = 0
    for name, module in model.named_modules():
        if mode == "fp8" and _is_lm_head(name):
            continue
        if isinstance(module, (Linear, ParallelLMHead)) and module.quantized is None:
            bias = getattr(module, "bias", None)
            module.quantized = quantized_linear(module.weight, bias, mode, group_size, _is_lm_head(name))
            module.weight = None
            if bias is not None:
                module.bias = None
            total += sum(b.numel() * b.element_size() for b in module.quantized.buffers())
    return total


def swap_linears(model: nn.Module, mode: str, group_size: int = 32, dense_rows: int = -1) -> nn.Module:
    """Replaces every torch nn.Linear of a model from elsewhere (HF transformers', for the tests
    and benchmarks that compare against it) by its quantized form, multiplying by a dense copy
    from `dense_rows` rows of input (-1: never); returns the model."""
    check_quantization(mode, group_size)
    if mode != "none":
        for parent_name, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    head = _is_lm_head(f"{parent_name}.{name}" if parent_name else name)
                    if mode == "fp8" and head:
                        continue
                    layer = quantized_linear(child.weight, child.bias, mode, group_size, head)
                    if mode != "fp8":
                        (layer.quantized if head else layer).use_dense_from(dense_rows if dense_rows > 0 else None)
                    setattr(parent, name, layer)
    return model


def _is_lm_head(module_name: str) -> bool:
    return module_name.rpartition(".")[2] == "lm_head"
