"""A float32 model's linear layers on a CPU: torch's matmul against oneDNN's on a copy of each
weight in its layout (what `tune_cpu_linears` chooses between per weight shape and row count at
start-up), side by side in one run.

    1. each weight shape alone: torch's time over oneDNN's at 1-256 rows (decode batches; the
       k + 1 rows of a verification), and the rows the engine chose for the copy
    2. the engine with its copies and with torch's matmul only (`cpu_weight_copies` false), the
       same chat prompts interleaved, greedy: tok/s and ms per step at each batch size, and
       whether the outputs are identical

    python -m perf.bench_cpu_linears --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.model.linear_tuner import time_call
from backend.sampling_params import SamplingParams
from perf.prompts import chat_prompts
from serving.launch.launcher import DEFAULT_MODEL_REPOSITORY

DEFAULT_MODEL = DEFAULT_MODEL_REPOSITORY / "llm_engine" / "1" / "target"
ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 256)


def median_ms(fn) -> float:
    return time_call(fn, None, 15) * 1e3  # the start-up tuner's timing: median of 15 after a warm-up


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, list[list[int]]]:
    """(tok/s, ms per step, outputs) of the prompts run together."""
    outputs: dict[str, list[int]] = {}
    for p in prompts:
        outputs[engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))] = []
    started, tokens, steps = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
            tokens += len(out.token_ids)
        steps += 1
    seconds = time.perf_counter() - started
    return tokens / seconds, seconds / steps * 1e3, list(outputs.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 3, 4, 8, 32])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    knobs = dict(model=str(args.model), speculative_method="none", num_threads=args.threads,
                 kv_cache_memory_bytes=512 * 2**20)
    engines = {"oneDNN copies": LLMEngine(EngineConfig(**knobs)),
               "torch matmul": LLMEngine(EngineConfig(**knobs, cpu_weight_copies=False))}
    chosen = engines["oneDNN copies"].linear_choices.get("target", {})

    print(f"\n{args.model.name}, float32, {args.threads} threads: torch's time / oneDNN's (copy) per product\n")
    print("| weight (out, in) | " + " | ".join(f"{r} rows" for r in ROWS) + " | copy used at rows |")
    print("|---|" + "---:|" * len(ROWS) + "---|")
    for shape in chosen:
        weight = torch.randn(shape)
        copy = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        ratios = []
        for rows in ROWS:
            x = torch.randn(rows, shape[1])
            plain = median_ms(lambda: F.linear(x, weight))
            onednn = median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, copy, None, "none", [], ""))
            ratios.append(f"{plain / onednn:.2f}x")
        span = chosen[shape]["onednn_rows"]
        used = "none" if span is None else f"{span[0]}-{span[1] if span[1] is not None else ''}"
        print(f"| {shape} | " + " | ".join(ratios) + f" | {used} |")

    prompts = chat_prompts(engines["torch matmul"].tokenizer, max(args.batch_sizes), seed=3)
    print(f"\nthe engine, greedy, {args.max_tokens} new tokens per request, median of {args.repeats} interleaved rounds\n")
    print("| batch | oneDNN copies: tok/s, ms/step | torch matmul: tok/s, ms/step | ratio | identical outputs |")
    print("|---:|---:|---:|---:|---|")
    for batch in args.batch_sizes:
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        outputs = {}
        for _ in range(args.repeats):  # interleaved: load drifting on a shared host hits both alike
            for name, engine in engines.items():
                rate, ms, outputs[name] = run(engine, prompts[:batch], args.max_tokens)
                results[name].append((rate, ms))
        (a, a_ms), (b, b_ms) = ((statistics.median(r for r, _ in results[n]), statistics.median(m for _, m in results[n]))
                                for n in engines)
        same = sum(x == y for x, y in zip(*outputs.values()))
        print(f"| {batch} | {a:.1f}, {a_ms:.1f} | {b:.1f}, {b_ms:.1f} | {a / b:.2f}x | {same}/{batch} |")


if __name__ == "__main__":
    main()
