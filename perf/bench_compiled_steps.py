"""Prefill and decode steps of the default model in-process, side by side in one run: the torch
reference attention or the CPU kernel (`attention_backend` torch / cpu), decode steps compiled
(`compile_decode`), and prefill, verification and mixed steps compiled too (`compile_prefill`).

Each configuration is one engine (quantization --quantization, --threads threads); for each prompt
length of --prompt-lengths, a prompt alone is prefilled (one token asked, so the step ends with
its prefill; prefix caching off, so every repeat prefills it all), median of --repeats after 3
warm-ups; for each count of --bursts, that many 13-token prompts arriving together (the time until
the last has its token: one step of them all), median of 5 after 1 warm-up; then a batch-1 decode
step (perf/harness.py's `decode_steps`), median of 64.

    python -m perf.bench_compiled_steps --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams
from perf.harness import decode_steps
from perf.prompts import DEFAULT_TARGET

CONFIGS = {  # label -> engine knobs
    "torch attention, decode compiled": dict(attention_backend="torch", compile_decode=True),
    "cpu attention, decode compiled": dict(attention_backend="cpu", compile_decode=True),
    "cpu attention, decode and prefill compiled": dict(attention_backend="cpu", compile_decode=True,
                                                       compile_prefill=True),
}


def prefill_seconds(engine: LLMEngine, length: int, prompts: int = 1) -> float:
    for i in range(prompts):
        engine.add_request(list(range(100 + i, 100 + i + length)), SamplingParams(max_tokens=1, temperature=0.0))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_TARGET)
    p.add_argument("--quantization", default="int4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[8, 13, 24])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--bursts", type=int, nargs="+", default=[8, 32])
    args = p.parse_args()
    rows = {}
    for label, knobs in CONFIGS.items():
        engine = LLMEngine(EngineConfig(model=str(args.model), num_threads=args.threads, quantization=args.quantization,
                                        enable_prefix_caching=False, **knobs))
        times = []
        for length in args.prompt_lengths:
            for _ in range(3):
                prefill_seconds(engine, length)
            times.append(statistics.median(prefill_seconds(engine, length) for _ in range(args.repeats)))
        for prompts in args.bursts:
            prefill_seconds(engine, 13, prompts)
            times.append(statistics.median(prefill_seconds(engine, 13, prompts) for _ in range(5)))
        times.append(statistics.median(decode_steps(engine, 64)))
        rows[label] = times
        print(f"{label}: done", flush=True)
    first = next(iter(rows.values()))
    print(f"\n{args.model.name}, {args.quantization}, {args.threads} threads; ms, and the first row's time over each\n")
    heads = ([f"prefill {n} tokens" for n in args.prompt_lengths] + [f"{n} prompts of 13" for n in args.bursts]
             + ["decode step"])
    print("| configuration | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(heads))
    for label, times in rows.items():
        cells = [f"{t * 1e3:.1f} ({f / t:.2f}x)" for t, f in zip(times, first)]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
