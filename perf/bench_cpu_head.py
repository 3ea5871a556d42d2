"""The float32 lm_head on a CPU: torch's matmul against oneDNN's on a copy of the weight in its
layout (what `tune_cpu_head` chooses between at start-up), side by side in one run.

    1. the head alone: ms per product at 1-256 rows (decode batches; k + 1 rows of a verification)
    2. the engine with and without the copy, the same chat prompts interleaved, greedy: tok/s at
       batch 1, 8 and 32, and whether the outputs are identical

    python perf/bench_cpu_head.py --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from backend import engine as engine_module  # noqa: E402
from backend.config import EngineConfig  # noqa: E402
from backend.engine import LLMEngine  # noqa: E402
from backend.model.linear_tuner import time_call  # noqa: E402
from backend.sampling_params import SamplingParams  # noqa: E402
from perf.prompts import chat_prompts  # noqa: E402
from serving.launcher import DEFAULT_MODEL_REPOSITORY  # noqa: E402

DEFAULT_MODEL = DEFAULT_MODEL_REPOSITORY / "llm_engine" / "1" / "target"


def median_ms(fn) -> float:
    return time_call(fn, None, 15) * 1e3  # the start-up tuner's timing: median of 15 after a warm-up


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    outputs: dict[str, list[int]] = {}
    for p in prompts:
        outputs[engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))] = []
    started, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
            tokens += len(out.token_ids)
    return tokens / (time.perf_counter() - started), list(outputs.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    knobs = dict(model=str(args.model), speculative_method="none", num_threads=args.threads,
                 kv_cache_memory_bytes=512 * 2**20)
    with_copy = LLMEngine(EngineConfig(**knobs))
    tune = engine_module.tune_cpu_head
    engine_module.tune_cpu_head = lambda model: {}  # the second engine keeps torch's matmul
    try:
        without = LLMEngine(EngineConfig(**knobs))
    finally:
        engine_module.tune_cpu_head = tune

    weight = without.model.lm_head.weight
    copy = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    print(f"\n{args.model.name}: lm_head {tuple(weight.shape)} float32, {args.threads} threads\n")
    print("| rows | torch matmul ms | oneDNN copy ms | ratio |\n|---:|---:|---:|---:|")
    for rows in (1, 2, 3, 4, 8, 16, 32, 64, 256):
        x = torch.randn(rows, weight.shape[1])
        plain = median_ms(lambda: F.linear(x, weight))
        onednn = median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, copy, None, "none", [], ""))
        print(f"| {rows} | {plain:.2f} | {onednn:.2f} | {plain / onednn:.2f}x |")
    choice = next(iter(with_copy.linear_choices.get("target", {}).values()), {}).get("onednn_min_rows")
    print(f"\nchosen at start-up: the copy from {choice} rows on\n" if choice else "\nchosen at start-up: no copy\n")

    prompts = chat_prompts(with_copy.tokenizer, max(args.batch_sizes), seed=3)
    print("| batch | with the copy, tok/s | torch matmul, tok/s | ratio | identical outputs |\n|---:|---:|---:|---:|---|")
    for batch in args.batch_sizes:
        rates: dict[str, list[float]] = {"copy": [], "torch": []}
        for _ in range(args.repeats):  # interleaved: load drifting on a shared host hits both alike
            rate, got = run(with_copy, prompts[:batch], args.max_tokens)
            rates["copy"].append(rate)
            rate, expected = run(without, prompts[:batch], args.max_tokens)
            rates["torch"].append(rate)
        a, b = statistics.median(rates["copy"]), statistics.median(rates["torch"])
        same = sum(x == y for x, y in zip(got, expected))
        print(f"| {batch} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {same}/{batch} |")


if __name__ == "__main__":
    main()
