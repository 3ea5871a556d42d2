"""Per weight shape, which kernel multiplies, timed at startup: on CUDA torch's matmul or the Triton
small-batch kernel (with FP8 weights: torch's `_scaled_mm` or the kernel's FP8 form); on a CPU
with weight-only quantization, the packed kernel or a dense copy of the weight
(`tune_quantized_linears`); on a CPU in float32, per weight shape and row count, torch's matmul
or oneDNN's on a copy of the weight in its layout (`tune_cpu_linears`).

At batch 1-16 a linear layer reads its whole weight for a few rows of output; which kernel reads
it faster depends on the shape and the GPU. For each distinct weight shape of a model the tuner
times both at 1, 2, 4, 8 and 16 rows, each call after the L2 cache is flushed (the model's
weights do not stay in L2 between uses), and lets the kernel take the row counts up to the first
one where it is not faster. If tuning fails, torch's matmul is kept everywhere: a start-up
optimisation must not stop the engine.
"""
from __future__ import annotations

import logging
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from backend.model.model import Linear
from backend.model.linear_swap import RescoredHead
from backend.model.quantized_linear import KERNEL_DTYPE, Fp8Linear, WeightOnlyLinear
from specserve_kernels.gemv import MAX_ROWS, gemv

ROW_COUNTS = (1, 2, 4, 8, MAX_ROWS)
# decode batches and verifications (k + 1 rows); a prefill chunk is past the last
CPU_ROW_COUNTS = (1, 2, 3, 4, 8, 16, 32, 64)
ONEDNN_MARGIN = 1.05  # oneDNN's copy must be this much faster: at 1 row the two are often within noise
# packed against dense, from the most rows down. Not below 16: a layer timed alone has its weights in
# cache, and in a model's step they are not, where a dense copy reads 3.2x (bfloat16) the bytes of
# int4 blocks: on the AVX-512 Xeon the timing chose copies from 4-8 rows, which in the default model
# at 2 threads made decode steps of 4 and 8 requests 20.8 and 31.0 ms against 14.1 and 22.8 with
# copies from 16 rows, and 42-token prefills slower too (the lm_head's copy is 56 MB).
DENSE_ROW_COUNTS = (256, 128, 64, 32, 16)
REPEATS = 10
FLUSH_BYTES = 256 << 20  # more than any GPU's L2

log = logging.getLogger(__name__)


def time_call(fn, flush: torch.Tensor | None, repeats: int = REPEATS) -> float:
    """Median time of one call: GPU time after an L2 flush on CUDA, wall time elsewhere (where
    the kernel runs only under Triton's interpreter, for tests)."""
    fn()  # compiles the kernel
    if flush is None:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    events = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def rows_for_gemv(times: dict[int, tuple[float, float]]) -> int:
    """The most rows up to which the kernel was faster at every measured row count (0: none);
    times: rows -> (torch seconds, gemv seconds), in increasing rows."""
    chosen = 0
    for rows, (torch_seconds, gemv_seconds) in sorted(times.items()):
        if gemv_seconds >= torch_seconds:
            break
        chosen = rows
    return chosen


def tune_small_batch_linears(model: nn.Module) -> dict[tuple[int, int], dict]:
    """Sets every Linear's and FP8 layer's `gemv_max_rows`; returns, per weight shape (out, in),
    the rows chosen and both kernels' times at each row count measured ({} when tuning failed).
    (A model's FP8 layers and its float ones, the lm_head, have different shapes.)"""
    by_shape: dict[tuple[int, int], list[Linear | Fp8Linear]] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized is None:  # (quantized: its own kernels)
            by_shape.setdefault(tuple(module.weight.shape), []).append(module)
        elif isinstance(module, Fp8Linear):
            by_shape.setdefault(module.weight_shape, []).append(module)
    try:
        return _tune(model, by_shape)
    except Exception as e:
        log.warning("small-batch linear tuning failed (%r); using torch's matmul", e)
        for modules in by_shape.values():
            for module in modules:
                module.gemv_max_rows = 0
        return {}


def _products(layer: Linear | Fp8Linear):
    """(torch's product, the kernel's) of a layer, each x -> y."""
    if isinstance(layer, Fp8Linear):
        return layer.scaled_product, lambda x: gemv(x, layer.qweight, layer.bias, weight_scale=layer.scale)
    weight, bias = layer.weight, layer.bias
    return lambda x: F.linear(x, weight, bias), lambda x: gemv(x, weight, bias)


@torch.inference_mode()
def _tune(model: nn.Module, by_shape: dict[tuple[int, int], list[Linear | Fp8Linear]]) -> dict[tuple[int, int], dict]:
    if not by_shape:
        return {}
    device, dtype = next((p.device, p.dtype) for p in model.parameters())  # (the activations' dtype)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    report = {}
    for shape, modules in by_shape.items():
        torch_product, kernel_product = _products(modules[0])
        times = {}
        for rows in ROW_COUNTS:
            x = torch.randn(rows, shape[1], dtype=dtype, device=device)
            times[rows] = (time_call(lambda: torch_product(x), flush), time_call(lambda: kernel_product(x), flush))
            if times[rows][1] >= times[rows][0]:
                break  # more rows only favour torch's matmul further
        chosen = rows_for_gemv(times)
        for module in modules:
            module.gemv_max_rows = chosen
        report[shape] = {"gemv_max_rows": chosen, "seconds (torch, gemv) by rows": times}
    if flush is not None:
        del flush
        torch.cuda.empty_cache()
    return report


def rows_for_dense(times: dict[int, tuple[float, float]]) -> int | None:
    """The fewest rows from which the dense product was faster at every measured row count (None:
    at none); times: rows -> (packed seconds, dense seconds)."""
    chosen = None
    for rows, (packed_seconds, dense_seconds) in sorted(times.items(), reverse=True):
        if dense_seconds >= packed_seconds:
            break
        chosen = rows
    return chosen


def tune_quantized_linears(model: nn.Module, dense_rows: int) -> dict[tuple[int, int], dict]:
    """Sets, for every weight-only quantized layer, the rows of input from which it multiplies by a
    dense copy of its weight (`dense_dtype`): `dense_rows` for all (-1: never), or 0: per weight shape,
    the fewest rows from which the copy measured faster at every count of DENSE_ROW_COUNTS (none
    kept where the packed kernel always won). Returns the choice and the times per shape."""
    by_shape: dict[tuple[int, int], list[WeightOnlyLinear]] = {}
    for module in model.modules():
        layer = getattr(module, "quantized", None)
        layer = layer.quantized if isinstance(layer, RescoredHead) else layer
        if isinstance(layer, WeightOnlyLinear):
            by_shape.setdefault(layer.weight_shape, []).append(layer)
    report = {}
    for shape, layers in by_shape.items():
        times = {}
        if dense_rows == 0:
            times = _time_packed_and_dense(layers[0])
            chosen = rows_for_dense(times)
        else:
            chosen = None if dense_rows < 0 else dense_rows
        for layer in layers:
            layer.use_dense_from(chosen)
        report[shape] = {"dense_min_rows": chosen, "seconds (packed, dense) by rows": times}
    return report


@torch.inference_mode()
def _time_packed_and_dense(layer: WeightOnlyLinear) -> dict[int, tuple[float, float]]:
    layer.use_dense_from(1)  # the copy, made once
    return _time_without_and_with_copy(layer, "dense_min_rows", DENSE_ROW_COUNTS, layer.weight_shape[1],
                                       KERNEL_DTYPE, REPEATS // 2)


def _time_without_and_with_copy(layer: nn.Module, min_rows: str, row_counts: tuple[int, ...], in_features: int,
                                dtype: torch.dtype, repeats: int) -> dict[int, tuple[float, float]]:
    """rows -> (seconds of layer(x) without its copy, with it), at each of `row_counts` (most rows
    first) by setting the layer's `min_rows` attribute (the rows from which the copy multiplies)
    just above the count, then at it; stops at the first count where the copy was not faster
    (fewer rows only favour it less)."""
    times = {}
    for rows in row_counts:
        x = torch.randn(rows, in_features, dtype=dtype)
        setattr(layer, min_rows, rows + 1)
        without = time_call(lambda: layer(x), None, repeats)
        setattr(layer, min_rows, rows)
        times[rows] = (without, time_call(lambda: layer(x), None, repeats))
        if times[rows][1] >= without:
            break
    return times


def rows_for_copy(times: dict[int, tuple[float, float]]) -> range:
    """The row counts that multiply by a copy: from the fewest measured rows at which it was faster
    up to the last count of the unbroken run of wins that follows (row counts between two winning
    counts win too), and with no upper limit where that run reaches the most rows measured, since a
    product of more rows is a GEMM either way. times: rows -> (plain seconds, copy seconds)."""
    counts = sorted(times)
    won = [times[rows][1] < times[rows][0] for rows in counts]
    if not any(won):
        return range(0)
    first = last = won.index(True)
    while last + 1 < len(counts) and won[last + 1]:
        last += 1
    return range(counts[first], sys.maxsize if last == len(counts) - 1 else counts[last] + 1)


@torch.inference_mode()
def tune_cpu_linears(model: nn.Module) -> dict[tuple[int, int], dict]:
    """A float32 model's Linear layers on a CPU with oneDNN: per weight shape, times torch's matmul
    against oneDNN's on a copy of the weight in its layout at each count of CPU_ROW_COUNTS, and
    gives every layer of that shape a copy used at the row counts where it was faster by
    ONEDNN_MARGIN (`rows_for_copy`; no copy where it never was). A copy holds as many bytes as its
    weight. Returns, per shape, the rows chosen and the times; {} where it does not apply. If timing
    fails, torch's matmul is kept: a start-up optimisation must not stop the engine."""
    if not torch.backends.mkldnn.is_available():
        return {}
    by_shape: dict[tuple[int, int], list[Linear]] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized is None and module.weight.dtype == torch.float32 \
                and module.weight.device.type == "cpu":
            by_shape.setdefault(tuple(module.weight.shape), []).append(module)
    report = {}
    for shape, layers in by_shape.items():
        try:
            layers[0].onednn_weight = torch.ops.mkldnn._reorder_linear_weight(layers[0].weight, None)
            times = _time_plain_and_onednn(layers[0])
            chosen = rows_for_copy({rows: (plain, onednn * ONEDNN_MARGIN) for rows, (plain, onednn) in times.items()})
        except Exception as e:
            log.warning("timing oneDNN's product for %s failed (%r); using torch's matmul", shape, e)
            chosen, times = range(0), {}
        for i, layer in enumerate(layers):  # (the first layer's copy is the one timed)
            if not chosen:
                layer.onednn_weight = None
            elif i > 0:
                layer.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight, None)
            layer.onednn_rows = chosen
        # (first, last) rows that multiply by the copy, last None: no limit
        report[shape] = {"onednn_rows": (chosen.start, None if chosen.stop == sys.maxsize else chosen.stop - 1)
                         if chosen else None,
                         "seconds (torch, onednn) by rows": times}
    return report


def _time_plain_and_onednn(layer: Linear) -> dict[int, tuple[float, float]]:
    """rows -> (seconds of torch's product, of oneDNN's on the layer's copy), from 1 row up,
    stopping at the first count past a win where the copy was not faster (more rows then favour it
    no further)."""
    weight, bias, copy = layer.weight, layer.bias, layer.onednn_weight
    times: dict[int, tuple[float, float]] = {}
    won = False
    for rows in CPU_ROW_COUNTS:
        x = torch.randn(rows, weight.shape[1])
        plain = time_call(lambda: F.linear(x, weight, bias), None)
        onednn = time_call(lambda: torch.ops.mkldnn._linear_pointwise(x, copy, bias, "none", [], ""), None)
        times[rows] = (plain, onednn)
        if onednn * ONEDNN_MARGIN < plain:
            won = True
        elif won:
            break
    return times
