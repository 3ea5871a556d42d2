"""4-bit weights times int16-quantized activations on an x86 CPU (AVX2, FMA, F16C): int4_cpu.c, and
built again with AVX-512 where the CPU has it (the same arithmetic, four blocks an instruction; with
AVX512-VNNI's fused products where it has them).

torch's packed int4 CPU kernel (`_weight_int4pack_mm_for_cpu`) turns every weight into a float
for every row of input, so a 13-token prefill's projections took 5.5x a single row's time. Here
each block of 32 input values is quantized to int16 with its own step (and its float sum kept), and
a weight block (32 codes, a float16 scale and minimum: GGUF's Q4_1) meets it in integer products,
as llama.cpp multiplies Q4_1 weights by quantized activations: the weights are unpacked once for
every four rows of input. (llama.cpp's activations are int8; on the default model they cost
greedy agreement with float32 0.994 -> 0.944, and 16 bits cost the kernel little.)

    pack(codes) -> qs                        codes [out, in] in [0, 15] -> [out, in / 2] bytes
    int4_linear_ref(x, qs, scale, minimum)   torch: the same quantization, products and sums
    int4_linear(x, qs, scale, minimum)       the kernel: x [m, in] float32 -> [m, out] float32
    isa()                                    which of the two it runs here: "avx512" or "avx2"

The kernel is compiled on first use (kernels/specserve_kernels/c_library.py); `available()` is False where it
cannot be (not x86 with AVX2, no compiler), and callers keep torch's kernel. Where the AVX-512 one
cannot be built, the AVX2 one runs.
`torch.ops.specserve.int4_linear` is the same product as a torch operator, for compiled graphs
(implemented in C++ where kernels/specserve_kernels/cpu_ops.py builds).
"""
from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from specserve_kernels import c_library, cpu_ops

BLOCK = 32  # weights (and input values) sharing a scale
SOURCE = pathlib.Path(__file__).with_suffix(".c")
AVX512_FLAGS = (*c_library.AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl")
QMAX = 32767  # x's values in int16


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] (0..15, in a multiple of 32) -> [out, in / 2] uint8: in each block of 32,
    byte j holds code j (low nibble) and code j + 16 (high nibble)."""
    out, width = codes.shape
    blocks = codes.to(torch.uint8).view(out, width // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out, width // 2)


def unpack(qs: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack`: [out, in / 2] uint8 -> [out, in] uint8 codes."""
    out, half = qs.shape
    blocks = qs.view(out, half // (BLOCK // 2), 1, BLOCK // 2)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).reshape(out, half * 2)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, in] float32 -> int16 values [m, in / 32, 32], steps and float sums [m, in / 32], as the
    kernel makes them: step = absolute maximum / 32767, values x * (1 / step) rounded to nearest even."""
    blocks = x.float().view(x.shape[0], x.shape[1] // BLOCK, BLOCK)
    step = blocks.abs().amax(dim=-1) / QMAX
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    return (blocks * inverse[..., None]).round().to(torch.int16), step, blocks.sum(dim=-1)


def int4_linear_ref(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """x [m, in] times the weight w = code * scale + minimum (scale, minimum [out, in / 32] float16):
    per block, scale * step * (codes . int16 values) + minimum * sum, summed in float32."""
    values, step, sums = quantize_blocks(x)
    codes = unpack(qs).view(qs.shape[0], qs.shape[1] * 2 // BLOCK, BLOCK).to(torch.int32)  # [out, blocks, 32]
    dots = torch.einsum("mbj,obj->mob", values.to(torch.int32), codes).float()  # exact integers (< 2^24)
    return (dots * scale.float()[None] * step[:, None] + minimum.float()[None] * sums[:, None]).sum(-1)


def int4_linear(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                kernel: str | None = None) -> torch.Tensor:
    """The kernel, same contract as `int4_linear_ref` (x float32, any row count, contiguous);
    `kernel` "avx2" or "avx512" names one (the CPU must have it), None: `isa()`'s."""
    x = x.contiguous()
    m, width = x.shape
    out = qs.shape[0]
    y = torch.empty(m, out, dtype=torch.float32)
    _library(kernel or isa()).int4_linear(x.data_ptr(), m, width, qs.data_ptr(), scale.data_ptr(), minimum.data_ptr(), out,
                           y.data_ptr(), torch.get_num_threads())
    return y


@functools.cache
def available() -> bool:
    """Whether the kernel runs here (built now if not cached)."""
    return c_library.runs(lambda: _library("avx2"), "int4 layers use torch's packed kernel")


def avx512() -> bool:
    """Whether this CPU has AVX-512 (F, BW, VL; torch's own AVX-512 kernels need the same)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


@functools.cache
def isa() -> str:
    """The kernel that runs here: "avx512" where the CPU has it and it builds, else "avx2"."""
    if avx512() and c_library.runs(lambda: _library("avx512"), "int4 layers use the AVX2 kernel"):
        return "avx512"
    return "avx2"


def kernel_function() -> ctypes._CFuncPtr | None:
    """The C function `int4_linear` calls here by default (None where the kernel does not run)."""
    return _library(isa()).int4_linear if available() else None


def _vnni() -> bool:
    """Whether the CPU has AVX512-VNNI (torch's own probe; False where this torch has none)."""
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    return bool(probe is not None and probe())


@functools.cache
def _library(kernel: str) -> ctypes.CDLL:
    if kernel == "avx512":  # VNNI's fused products where the CPU has them (the source asks __AVX512VNNI__)
        lib = c_library.load(SOURCE, (*AVX512_FLAGS, *(("-mavx512vnni",) if _vnni() else ())))
    else:
        lib = c_library.load(SOURCE)
    lib.int4_linear.restype = None
    lib.int4_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    return lib


# Defined through torch.library.Library rather than the custom_op decorator: a decorated op's
# Python wrapper took 24 us of every call (44 us against 20 us for a 576 x 576 layer at one row),
# 3 ms of a compiled decode step's 121 calls; the plain registration takes 4 us.
_LIBRARY = torch.library.Library("specserve", "FRAGMENT")
_LIBRARY.define("int4_linear(Tensor x, Tensor qs, Tensor scale, Tensor minimum) -> Tensor")
IMPLEMENTATION = cpu_ops.implement(_LIBRARY, "int4_linear", int4_linear, kernel_function)  # "c++" or "python"


@torch.library.register_fake("specserve::int4_linear", lib=_LIBRARY)
def _(x, qs, scale, minimum):
    return x.new_empty(x.shape[0], qs.shape[0], dtype=torch.float32)


int4_linear_op = torch.ops.specserve.int4_linear.default
