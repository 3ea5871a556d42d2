"""Per weight shape, torch's matmul or the Triton small-batch kernel, timed at startup on CUDA.

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
import time

import torch
import torch.nn.functional as F
from torch import nn

from backend.model.model import Linear
from kernels.gemv import MAX_ROWS, gemv

ROW_COUNTS = (1, 2, 4, 8, MAX_ROWS)
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
    """Sets every Linear's `gemv_max_rows`; returns, per weight shape (out, in), the rows chosen
    and both kernels' times at each row count measured ({} when tuning failed)."""
    by_shape: dict[tuple[int, int], list[Linear]] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized is None:  # (quantized: its own kernels)
            by_shape.setdefault(tuple(module.weight.shape), []).append(module)
    try:
        return _tune(model, by_shape)
    except Exception as e:
        log.warning("small-batch linear tuning failed (%r); using torch's matmul", e)
        for modules in by_shape.values():
            for module in modules:
                module.gemv_max_rows = 0
        return {}


@torch.inference_mode()
def _tune(model: nn.Module, by_shape: dict[tuple[int, int], list[Linear]]) -> dict[tuple[int, int], dict]:
    if not by_shape:
        return {}
    device = next(model.parameters()).device
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    report = {}
    for shape, modules in by_shape.items():
        weight, bias = modules[0].weight, modules[0].bias
        times = {}
        for rows in ROW_COUNTS:
            x = torch.randn(rows, shape[1], dtype=weight.dtype, device=device)
            times[rows] = (time_call(lambda: F.linear(x, weight, bias), flush),
                           time_call(lambda: gemv(x, weight, bias), flush))
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
