"""Weight-only quantized linear layers, made at load from a model's float weights.

A decode step at small batch reads every weight once for a few rows of output, so its time is the
weights' bytes over the memory bandwidth; fewer bytes per weight is the whole gain.

    int8   w = q * scale[n]                       q in [-127, 127], one scale per output row
    int4   w = q * scale[n, g] + minimum[n, g]    q in [0, 15], per group of `group_size` inputs
    fp8    w = q * scale[n]                       q float8_e4m3fn, one scale per output row; each
                                                  row of input quantized to FP8 the same way per call

The lm_head is quantized the same way, and each row's 32 highest logits are then computed again
from its float weight (`RescoredHead`: the embedding table when tied, so nothing is copied): on the
default model an int4 lm_head alone cost greedy agreement with float32 0.9945 -> 0.915, rescored it
costs nothing measurable. The embedding table is left as it is (a lookup reads one row per token).

int4 is asymmetric with a group's minimum and (maximum - minimum) / 15 as its step, GGUF's Q4_1
layout: weights dequantized from Q4_1 blocks of 32 (the default model's) come back exactly at
group size 32 (the step and minimum in float16, as Q4_1 keeps them).

On an x86 CPU with AVX2, int4 products run in kernels/specserve_kernels/int4_cpu.py: each block of 32 input values
quantized to int16 and multiplied by the 4-bit codes in integers, as llama.cpp does, so that a
prefill's rows do not each pay for turning every weight into a float. Elsewhere on a CPU, and for
int8, the products run in torch's packed weight-only kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`, with bfloat16 scales). Those are fast with bfloat16 activations
only (their float32 and float16 paths run 10-30x slower), so a layer casts its input to bfloat16
for the product and the result back: the residual stream, norms, RoPE and attention keep the
model's dtype. On other devices a layer multiplies by its dequantized weight (correct, no faster
than the float model).

The packed kernels' time grows with the rows (torch's convert every weight to a float for every
row of input): at a prefill's hundreds of rows a dense GEMM is several times faster. A layer can
keep a copy of its dequantized weight and use it from `dense_min_rows` rows of input on
(`use_dense_from`; backend/model/linear_tuner.py times both per weight shape at load), in oneDNN's
layout (`prepack`): in bfloat16 where the CPU multiplies bfloat16 natively (AVX-512 BF16, AMX), in
float32 elsewhere, where a bfloat16 GEMM is emulated and slower than the packed kernels (`dense_dtype`).
Compiled steps choose the same way inside the int4 operator they call (a branch on the row count
in the traced code would split a graph in two); int8 layers keep their packed kernels there.

`fp8` is for GPUs with FP8 tensor cores (compute capability 8.9 on: Ada, Hopper), as vLLM's
dynamic FP8: weights and activations both FP8 with per-row scales, multiplied by torch's
`_scaled_mm` (summing in float32), and up to `gemv_max_rows` rows of input by the Triton
small-batch kernel, which reads the FP8 weight, quantizes the input rows the same way and
multiplies exactly (kernels/specserve_kernels/gemv.py; backend/model/linear_tuner.py times the two per shape at
load). It halves a bfloat16 model's weight bytes, so a decode step bound by reading them takes up
to half the time. The lm_head stays in the model's dtype (as in vLLM's FP8 checkpoints): its
logits choose the tokens. On a CPU, torch's `_scaled_mm` gives the same products, slowly: for
measuring FP8's quality, not for serving.
"""
from __future__ import annotations

import functools
import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from backend.errors import ValidationError
from specserve_kernels import cpu_ops, int4_cpu
from specserve_kernels.gemv import fp8_scales, gemv, to_fp8

KERNEL_DTYPE = torch.bfloat16  # the packed CPU kernels' activations, scales and output
INT4_ROWS = 16  # the packed int4 layout holds output rows in multiples of this (padded with zeros)


CLIP_RATIOS = torch.linspace(0.6, 1.0, 21).tolist()  # int8: a row's range is searched down to 60% of its max


def int8_row_scales(w: torch.Tensor) -> torch.Tensor:
    """Per row, the scale (a clipped max / 127, in bfloat16) of least squared error: clipping a row's few
    largest weights buys a finer step for all the others (measured on the default model: greedy
    agreement with float32 0.9695 at max / 127, 0.9736 with the search)."""
    amax = w.abs().amax(dim=1)
    best_scale, best_err = None, None
    for ratio in CLIP_RATIOS:
        scale = (amax * ratio / 127).clamp(min=2**-100).to(KERNEL_DTYPE).float()  # as the kernel reads it
        err = ((w / scale[:, None]).round().clamp(-127, 127) * scale[:, None] - w).pow(2).sum(dim=1)
        if best_scale is None:
            best_scale, best_err = scale, err
        else:
            better = err < best_err
            best_scale, best_err = torch.where(better, scale, best_scale), torch.where(better, err, best_err)
    return best_scale


@functools.cache  # asked on every dense product; the CPU does not change
def onednn_bfloat16() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 matmuls natively (AVX-512 with BF16, or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def dense_dtype() -> torch.dtype:
    """The dense copies' dtype: bfloat16 where oneDNN multiplies it natively, float32 elsewhere
    (on an AVX2-only CPU a bfloat16 GEMM is emulated: the default model's gate/up projection at 256
    rows took 62 ms in bfloat16, 14 ms packed int4 and 7.3 ms in float32)."""
    return torch.bfloat16 if onednn_bfloat16() else torch.float32


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """A dense [out, in] weight in oneDNN's blocked layout for its matmul (bfloat16 where the CPU
    multiplies it natively; float32 on any CPU oneDNN runs on), the weight as it is elsewhere.
    torch's plain bfloat16 matmul reorders the weight into that layout on every call (measured on
    the default model's layer shapes at 2 threads: a prepacked product of 1-13 rows takes 13 ms for
    all 30 layers against 20 ms), and on an AVX2-only CPU oneDNN's prepacked float32 product runs
    1.05-1.5x torch's (MKL's) at 128-416 rows of the default model's shapes (150 against 100-143
    GFLOP/s at 2 threads)."""
    native = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and onednn_bfloat16())
    if weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and native:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return weight


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] times a weight from `prepack`, both in `dense_dtype()`."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")
    return F.linear(x, weight)


# Dense copies by number, for the operator compiled graphs call (`int4_product`): a prepacked copy
# is an opaque oneDNN tensor, which a graph cannot take as an input. Held weakly: a layer's copy
# goes with the layer.
_DENSE_COPIES: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_DENSE_NUMBERS = itertools.count()


class WeightOnlyLinear(nn.Module):
    """What both packed layers share: the dense copy for many rows, when kept."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight_shape = tuple(weight.shape)  # (out, in)
        self.dense_weight: torch.Tensor | None = None  # [out, in] in dense_dtype(), the dequantized weight
        self.dense_min_rows = 0  # rows of input from which dense_weight multiplies
        self.dense_number = -1  # dense_weight's in _DENSE_COPIES (-1: none)

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] float32
        raise NotImplementedError

    def use_dense_from(self, rows: int | None) -> None:
        """Multiply inputs of `rows` rows or more by a copy of the dequantized weight in
        `dense_dtype()` (None: never, and no copy kept)."""
        self.dense_weight = None if rows is None else prepack(self.dequantized_weight().to(dense_dtype()))
        self.dense_min_rows = rows or 0
        self.dense_number = -1
        if self.dense_weight is not None:
            self.dense_number = next(_DENSE_NUMBERS)
            _DENSE_COPIES[self.dense_number] = self.dense_weight

    @property
    def dense_in_graphs(self) -> bool:
        """Whether compiled graphs multiply by the dense copy from dense_min_rows rows on, as eager
        steps do (they keep the packed kernel here; Int4Linear's do)."""
        return False

    def dense_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [rows, in] times the dense copy, [rows, out] in the copy's dtype; None where the
        packed kernel is to run."""
        # (compiling first: a comparison of the traced row count would be a condition on the graph)
        if torch.compiler.is_compiling() or self.dense_weight is None or x.shape[0] < self.dense_min_rows:
            return None
        return dense_linear(x.to(self.dense_weight.dtype), self.dense_weight)


class Int8Linear(WeightOnlyLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight)
        w = weight.detach().float()
        scale = int8_row_scales(w)
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(KERNEL_DTYPE))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] float32
        return self.qweight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.qweight.device.type == "cpu":
            rows = as_rows(x)
            y = self.dense_product(rows)
            if y is None:
                y = torch._weight_int8pack_mm(rows.to(KERNEL_DTYPE), self.qweight, self.scale)
            y = unflatten_rows(y.to(x.dtype), x)
        else:
            y = F.linear(x, (self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]))
        return y if self.bias is None else y + self.bias


class Int4Linear(WeightOnlyLinear):
    """w = code * step + minimum per group. Where kernels/specserve_kernels/int4_cpu.py runs (an x86 CPU with AVX2
    and a C compiler: `layout` "blocks"), the codes in its blocks of 32 with float16 steps and
    minimums, as GGUF's Q4_1 keeps them (a group of 64 or 128 repeats its own over its blocks); on
    other CPUs torch's packed layout ("int4pack", bfloat16 scales); elsewhere one code a byte ("codes")."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int):
        super().__init__(weight)
        out_features, in_features = weight.shape
        if in_features % group_size:
            raise ValidationError("quantization_group_size", f"must divide every layer's input width; "
                                  f"{group_size} does not divide {in_features}")
        self.out_features, self.group_size = out_features, group_size
        cpu = weight.device.type == "cpu"
        self.layout = ("blocks" if int4_cpu.available() else "int4pack") if cpu else "codes"
        if self.layout == "blocks":
            groups = weight.detach().float().view(out_features, in_features // group_size, group_size)
            if groups.abs().max() > torch.finfo(torch.float16).max:
                raise ValidationError("quantization", f"int4 holds weights within +-65504 (float16 steps and "
                                                      f"minimums); a layer has {float(groups.abs().max()):g}")
            # the codes are rounded against the step and minimum as the kernel reads them (float16)
            minimum = groups.amin(dim=-1).half()
            step = ((groups.amax(dim=-1) - minimum.float()) / 15).clamp(min=2**-24).half()
            codes = ((groups - minimum.float()[..., None]) / step.float()[..., None]).round().clamp(0, 15)
            codes = codes.view(out_features, in_features)
            repeat = group_size // int4_cpu.BLOCK
            self.register_buffer("qweight", int4_cpu.pack(codes))
            self.register_buffer("step", step.repeat_interleave(repeat, dim=1).contiguous())
            self.register_buffer("minimum", minimum.repeat_interleave(repeat, dim=1).contiguous())
        else:
            self._quantize_for_torch(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def _quantize_for_torch(self, weight: torch.Tensor) -> None:
        """torch's packed layout (output rows padded to INT4_ROWS) or one code a byte, with
        bfloat16 scales and zeros as torch's kernel reads them."""
        in_features = weight.shape[1]
        rows = -(-self.out_features // INT4_ROWS) * INT4_ROWS
        w = weight.detach().float().new_zeros(rows, in_features)
        w[:self.out_features] = weight.detach().float()
        groups = w.view(rows, in_features // self.group_size, self.group_size)
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
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
                             if self.layout == "int4pack" else codes.to(torch.uint8))

    def codes(self) -> torch.Tensor:  # [rows, in] the 4-bit codes, as float32 (rows: with any padding)
        if self.layout == "blocks":
            return int4_cpu.unpack(self.qweight).float()
        if self.layout == "codes":
            return self.qweight.float()
        # read back through the kernel: the identity times the weight with scale 1 and zero 8
        eye = torch.eye(self.qweight.shape[1] * 2, dtype=KERNEL_DTYPE)
        unit = torch.tensor([1.0, 8.0], dtype=KERNEL_DTYPE).expand_as(self.scales_and_zeros).contiguous()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, unit).t().float()

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] float32
        codes = self.codes()
        rows, in_features = codes.shape
        if self.layout == "blocks":
            blocks = codes.view(rows, -1, int4_cpu.BLOCK)
            return (blocks * self.step.float()[..., None] + self.minimum.float()[..., None]).view(rows, in_features)
        scale, zero = self.scales_and_zeros.float().unbind(-1)  # [groups, rows]
        groups = codes.view(rows, in_features // self.group_size, self.group_size)
        w = (groups - 8) * scale.t()[..., None] + zero.t()[..., None]
        return w.view(rows, in_features)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.layout == "codes":
            y = F.linear(x, self.dequantized_weight().to(x.dtype))
            return y if self.bias is None else y + self.bias
        rows = as_rows(x)
        if self.layout == "blocks" and torch.compiler.is_compiling():
            # a compiled graph calls the kernel as an operator, which chooses the dense copy from
            # its row count itself (a comparison here would be a condition on the graph)
            y = int4_product_op(rows.float(), self.qweight, self.step, self.minimum, self.dense_number,
                                self.dense_min_rows)
            y = unflatten_rows(y.to(x.dtype), x)
            return y if self.bias is None else y + self.bias
        y = self.dense_product(rows)
        if y is None and self.layout == "blocks":  # (eagerly the kernel is called directly: no dispatch)
            y = int4_cpu.int4_linear(rows.float(), self.qweight, self.step, self.minimum)
        elif y is None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(KERNEL_DTYPE), self.qweight, self.group_size,
                                                           self.scales_and_zeros)
            if y.shape[1] != self.out_features:  # padding rows
                y = y[:, : self.out_features]
        y = unflatten_rows(y.to(x.dtype), x)
        return y if self.bias is None else y + self.bias

    @property
    def dense_in_graphs(self) -> bool:
        """In the kernel's layout ("blocks"), through the operator the graphs call (`int4_product`)."""
        return self.layout == "blocks" and self.dense_weight is not None


def int4_product(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                 dense: int, dense_min_rows: int) -> torch.Tensor:
    """x [rows, in] float32 times an int4 layer, float32: by its dense copy (`_DENSE_COPIES[dense]`)
    from dense_min_rows rows on, by the int4 kernel below that or without a copy (dense -1)."""
    if dense >= 0 and x.shape[0] >= dense_min_rows:
        return dense_product(x, dense)
    return int4_cpu.int4_linear(x, qs, scale, minimum)


def dense_product(x: torch.Tensor, dense: int) -> torch.Tensor:
    """x [rows, in] float32 times dense copy number `dense`, float32: `int4_product`'s dense part,
    an operator of its own for the C++ implementation of `int4_product` (kernels/specserve_kernels/cpu_ops.cpp)."""
    weight = _DENSE_COPIES[dense]
    return dense_linear(x.to(weight.dtype), weight).float()


# (torch.library.Library rather than the custom_op decorator: see kernels/specserve_kernels/int4_cpu.py)
_LIBRARY = torch.library.Library("specserve", "FRAGMENT")
_LIBRARY.define("dense_product(Tensor x, int dense) -> Tensor")
_LIBRARY.impl("dense_product", dense_product, "CPU")
_LIBRARY.define("int4_product(Tensor x, Tensor qs, Tensor scale, Tensor minimum, int dense, "
                "int dense_min_rows) -> Tensor")
INT4_PRODUCT = cpu_ops.implement(_LIBRARY, "int4_product", int4_product, int4_cpu.kernel_function)  # "c++"/"python"


@torch.library.register_fake("specserve::int4_product", lib=_LIBRARY)
def _(x, qs, scale, minimum, dense, dense_min_rows):
    return x.new_empty(x.shape[0], qs.shape[0], dtype=torch.float32)


int4_product_op = torch.ops.specserve.int4_product.default


FP8_WIDTH_MULTIPLE = 16  # _scaled_mm's rule for both widths of a weight
FP8_MIN_CAPABILITY = (8, 9)


class Fp8Linear(nn.Module):
    """y = x @ w.T + bias with w in FP8 (`qweight` [out, in] float8_e4m3fn, `scale` [out] float32)
    and x's rows quantized to FP8 per call; `gemv_max_rows`: the rows up to which the Triton kernel
    multiplies (0: never; set by backend/model/linear_tuner.py on CUDA)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        check_fp8_device(weight.device)
        if weight.shape[0] % FP8_WIDTH_MULTIPLE or weight.shape[1] % FP8_WIDTH_MULTIPLE:
            raise ValidationError("quantization", f"fp8 needs every layer's widths to be multiples of "
                                                  f"{FP8_WIDTH_MULTIPLE}, got a {tuple(weight.shape)} weight")
        self.weight_shape = tuple(weight.shape)  # (out, in)
        w = weight.detach().float()
        scale = fp8_scales(w)
        self.register_buffer("qweight", to_fp8(w, scale))
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.gemv_max_rows = 0

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] float32
        return self.qweight.float() * self.scale[:, None]

    def scaled_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out] through torch's `_scaled_mm` (bfloat16 out on CUDA: its only
        output for per-row scales)."""
        if x.shape[0] == 0:
            return x.new_empty(0, self.weight_shape[0])
        x_scale = fp8_scales(x)
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        y = torch._scaled_mm(to_fp8(x, x_scale), self.qweight.t(), scale_a=x_scale[:, None],
                             scale_b=self.scale[None, :], out_dtype=out_dtype)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = as_rows(x)
        if rows.shape[0] <= self.gemv_max_rows:
            y = gemv(rows, self.qweight, self.bias, weight_scale=self.scale)
        else:
            y = self.scaled_product(rows)
        return unflatten_rows(y, x)


def check_fp8_device(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        have = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValidationError("quantization", f"fp8 needs a GPU of compute capability 8.9 or later (Ada, "
                                              f"Hopper); this one has {have}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the 2-D input the packed kernels take (the engine's activations already are)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def unflatten_rows(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


