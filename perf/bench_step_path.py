"""The step path's properties, measured: graph replays and host waits per decode step,
milliseconds per token, and host milliseconds per step (the step less its runners' forwards:
scheduling, building inputs, sampling bookkeeping, drafting's own work), for plain decoding and
for draft speculation, with and without overlapped steps, by batch size. On a GPU a decode step
should replay one graph per forward (the target's, and each draft forward's) and wait once (plain,
overlapped) or at most twice (speculation, overlapped); on a CPU there are no graphs, but the
waits are counted the same way.

    python -m perf.bench_step_path                          # tiny shape, batch 1 and 8
    python -m perf.bench_step_path --batch-sizes 1 8 64     # host time per speculative step
    python -m perf.bench_step_path --shape 1b --batch-sizes 1 8 64 --json out.json   # on a GPU
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from backend.config import EngineConfig
from backend.device import resolve_device
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams
from perf.harness import PartTimer, sync
from perf.random_checkpoints import SHAPE_1B, SHAPE_TINY, write_model

MODES = {  # name -> engine knobs (the draft is the target itself: every draft accepted)
    "plain": dict(async_scheduling=False),
    "plain, overlapped": dict(async_scheduling=True),
    "draft k=3": dict(speculative_method="draft", num_speculative_tokens=3, adaptive_speculation=False,
                      async_scheduling=False),
    "draft k=3, overlapped": dict(speculative_method="draft", num_speculative_tokens=3,
                                  adaptive_speculation=False, async_scheduling=True),
}


def measure(model: Path, device: str, dtype: str, knobs: dict, batch: int, steps: int, rng: random.Random) -> dict:
    draft = {"draft_model": str(model)} if knobs.get("speculative_method") else {}
    engine = LLMEngine(EngineConfig(model=str(model), device=device, dtype=dtype, draft_dtype=dtype,
                                    max_num_seqs=max(batch, 1), **knobs, **draft))
    vocab = engine.model.args.vocab_size
    for _ in range(batch):
        engine.add_request([rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))],
                           SamplingParams(max_tokens=steps * 4 + 8, temperature=0.0, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and the first decode steps)
    for _ in range(3):
        engine.step()  # warm-up
    replays = engine.stats().graph_replays_total
    waits_before = len(engine.host_waits.per_step)
    tokens = 0
    parts = PartTimer(engine.device)  # each runner's forwards, less the inputs they build (host work)
    runners = [engine.runner] + ([engine.speculator.proposer.runner] if knobs.get("speculative_method") else [])
    for runner in runners:
        parts.wrap(runner, "run", "run")
        parts.wrap(runner, "prepare", "inputs")
        parts.wrap(runner, "graph_inputs", "inputs")
    sync(engine.device)
    started = time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(o.token_ids) for o in engine.step())
    sync(engine.device)
    seconds = time.perf_counter() - started
    forward_seconds = parts.seconds["run"] - parts.seconds["inputs"]
    waits = list(engine.host_waits.per_step)[waits_before - len(engine.host_waits.per_step):] or [0]
    forwards_per_step = 1 + (knobs.get("num_speculative_tokens", 0) if knobs.get("speculative_method") else 0)
    return dict(batch=batch, steps=steps, tokens=tokens, ms_per_step=1e3 * seconds / steps,
                host_ms_per_step=1e3 * (seconds - forward_seconds) / steps,
                ms_per_token_per_request=1e3 * seconds * batch / max(tokens, 1),
                graph_replays_per_step=(engine.stats().graph_replays_total - replays) / steps,
                forwards_per_step=forwards_per_step, host_waits_mean=statistics.mean(waits), host_waits_max=max(waits))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("tiny", "1b"), default="tiny")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--device", default="auto")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    device = resolve_device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), SHAPE_1B if args.shape == "1b" else SHAPE_TINY, device)
        print("| mode | batch | ms/step | host ms/step | ms/token/request | graph replays/step | forwards/step "
              "| host waits/step (mean, max) |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for mode in args.modes:
            for batch in args.batch_sizes:
                row = dict(mode=mode) | measure(Path(tmp), str(device), dtype, MODES[mode], batch, args.steps, rng)
                rows.append(row)
                print(f"| {mode} | {batch} | {row['ms_per_step']:.2f} | {row['host_ms_per_step']:.2f} | "
                      f"{row['ms_per_token_per_request']:.2f} | "
                      f"{row['graph_replays_per_step']:.2f} | {row['forwards_per_step']} | "
                      f"{row['host_waits_mean']:.2f}, {row['host_waits_max']} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(device=str(device), torch=torch.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
