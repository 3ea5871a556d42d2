"""Host work per engine step: what the CPU spends around the forward pass, by batch size.

On a GPU, everything the engine does besides the forward (scheduling, building the step's input
tensors, sampling bookkeeping, detokenization, outputs) runs on the host between kernels; at high
batch it, not the GPU, bounds throughput. This runs decode steps of a tiny model (the forward is
cheap and timed separately) and prints host milliseconds per step beside the step budget that a
throughput target leaves: at batch B, T tokens/s allows B / T seconds per decode step.

    python -m perf.bench_host                          # batch 1, 32, 128, 256; target 30,000 tok/s
    python -m perf.bench_host --batch-sizes 64 --steps 50
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams
from perf.harness import sync
from perf.random_checkpoints import SHAPE_TINY, write_model


def host_ms_per_step(engine: LLMEngine, batch_size: int, steps: int, rng: random.Random) -> tuple[float, float]:
    """(step ms, model forward ms) averaged over `steps` decode-only steps of `batch_size`
    requests. The forward is the runner's call minus building its input tensors (host work, for
    eager steps and decode graphs alike)."""
    vocab = engine.model.args.vocab_size
    for _ in range(batch_size):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(128, 1024))]
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()  # prefill
    forward = 0.0
    run, prepare, graph_inputs = engine.runner.run, engine.runner.prepare, engine.runner.graph_inputs

    def timed_run(step):
        nonlocal forward
        sync(engine.device)
        started = time.perf_counter()
        out = run(step)
        sync(engine.device)
        forward += time.perf_counter() - started
        return out

    def host_side(build):  # building the inputs (eager or graph) is host work
        def timed(*args):
            nonlocal forward
            started = time.perf_counter()
            out = build(*args)
            forward -= time.perf_counter() - started
            return out
        return timed

    engine.runner.run, engine.runner.prepare = timed_run, host_side(prepare)
    engine.runner.graph_inputs = host_side(graph_inputs)
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - started
    engine.runner.run, engine.runner.prepare, engine.runner.graph_inputs = run, prepare, graph_inputs
    while engine.has_unfinished_requests():
        engine.step()
    return total / steps * 1e3, forward / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128, 256])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--target-tok-s", type=float, default=30000.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), SHAPE_TINY, torch.device("cpu"))
        engine = LLMEngine(EngineConfig(model=tmp, max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=8192,
                                        kv_cache_memory_bytes=2**30, num_threads=args.threads))
        host_ms_per_step(engine, 4, 4, rng)  # warm-up
        for b in args.batch_sizes:
            step_ms, forward_ms = host_ms_per_step(engine, b, args.steps, rng)
            rows.append((b, step_ms, forward_ms, step_ms - forward_ms, b / args.target_tok_s * 1e3))
    print(f"\n{device}, tiny Llama ({SHAPE_TINY['hidden_size']} hidden), decode steps, prompts 128-1024 tokens, "
          f"mean of {args.steps} steps\n")
    print(f"| batch | step ms | forward ms | host ms | host us per request | step budget at {args.target_tok_s:,.0f} tok/s |")
    print("|---|---|---|---|---|---|")
    for b, step_ms, forward_ms, host, budget in rows:
        print(f"| {b} | {step_ms:.2f} | {forward_ms:.2f} | {host:.2f} | {host / b * 1e3:.0f} | {budget:.2f} ms |")


if __name__ == "__main__":
    main()
