"""Throughput of the engine against HF transformers on one mixed offline workload.

Three systems run the same requests in one process, on the same weights:
  engine         LLMEngine, every request added at once, stepped until none is left
  HF static      `model.generate` in padded batches (left padding + attention mask); each batch runs
                 to its longest max_tokens, but only each request's own max_tokens count as useful
  HF continuous  transformers' continuous batching manager (the machinery behind `generate_batch`),
                 driven directly so that each request gets its own max_new_tokens

Useful tokens/s = sum of every request's max_tokens / wall time (greedy, EOS ignored, so every
request generates exactly max_tokens). Each system is warmed up once on a small batch of other
prompts first. The engine's greedy outputs are checked against unpadded HF `generate` for a few
requests, since a fast wrong engine is a bug.

    python -m perf.bench_engine                       # 64 requests on a random 4-layer Llama
    python -m perf.bench_engine --quick               # 16 shorter requests
    python -m perf.bench_engine --threads 1 --repeats 2   # steadier on a shared CPU
    python -m perf.bench_engine --model model_repository/llm_engine/1/target --device cuda
    python -m perf.bench_engine --skip-hf --profile engine.prof   # where the engine's time goes
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from backend.config import EngineConfig
from backend.device import resolve_device
from backend.engine import LLMEngine
from backend.model.model_loader import TORCH_DTYPES
from backend.sampling_params import SamplingParams
from perf.harness import PartTimer, TimedSampler, Workload, add_model_and_workload_arguments, make_workload
from perf.random_checkpoints import write_random_llama


@dataclass(slots=True)
class RunResult:
    name: str
    wall_s: float
    useful_tokens: int
    outputs: list[list[int]]  # per request, in workload order: its first max_tokens tokens
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall_s


@dataclass(slots=True)
class KVStats:
    """The engine's KV pool and its occupancy at the step where the most blocks were in use."""

    num_blocks: int
    block_size: int
    pool_bytes: int
    peak_blocks_used: int = 0
    peak_running: int = 0  # requests holding blocks at that step
    peak_wasted_slots: int = 0  # allocated slots minus tokens whose K/V they hold, at that step


# -- systems ------------------------------------------------------------------------------------
def instrument(engine: LLMEngine, timer: PartTimer, kv: KVStats) -> None:
    """Time the engine's phases through the public methods of its parts (scheduler, runner,
    attention backend, sampler, host waits, output processor), and record KV occupancy whenever
    the number of blocks in use reaches a new peak (right after scheduling, when a step's blocks
    are all allocated)."""
    scheduler = engine.scheduler
    schedule = timer.timed("schedule", scheduler.schedule)

    def schedule_and_measure(*args, **kwargs):
        batch = schedule(*args, **kwargs)
        used = engine.num_blocks - engine.block_manager.num_free_blocks
        if used > kv.peak_blocks_used:
            scheduled = {r.request_id: n for r, n in zip(batch.requests, batch.num_scheduled_tokens)}
            held = sum(r.num_computed_tokens + scheduled.get(r.request_id, 0) for r in scheduler.running)
            kv.peak_blocks_used, kv.peak_running = used, len(scheduler.running)
            kv.peak_wasted_slots = used * engine.block_manager.block_size - held
        return batch

    scheduler.schedule = schedule_and_measure
    timer.wrap(engine.runner, "prepare", "prepare")
    timer.wrap(engine.runner, "run", "run")
    timer.wrap(engine.attention, "forward", "attention")
    timer.wrap(engine.attention, "rotate_and_store", "rotate_and_store")
    engine.sampler = TimedSampler(engine, timer, "sample")
    timer.wrap(engine.host_waits, "wait", "wait")
    timer.wrap(engine.output_processor, "advance", "outputs")


def run_engine(engine: LLMEngine, workload: Workload, progress: bool) -> RunResult:
    outputs: dict[str, list[int]] = {}
    order = []
    t0 = time.perf_counter()
    for prompt, max_tokens in zip(workload.prompts, workload.max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        order.append(engine.add_request(prompt, params))
    with tqdm(total=workload.useful_tokens, desc="engine", unit="tok", disable=not progress, leave=False) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.token_ids)
                bar.update(len(out.token_ids))
    wall = time.perf_counter() - t0
    return RunResult("engine", wall, workload.useful_tokens, [outputs[rid] for rid in order])


@torch.inference_mode()
def run_hf_static(model, workload: Workload, batch_size: int, pad_id: int, progress: bool) -> RunResult:
    outputs: list[list[int]] = []
    positions = 0  # token positions the padded batches run through (the engine runs through its useful ones)
    batches = range(0, len(workload.prompts), batch_size)
    t0 = time.perf_counter()
    for i in tqdm(batches, desc=f"HF static (batch {batch_size})", disable=not progress, leave=False):
        prompts, max_tokens = workload.prompts[i : i + batch_size], workload.max_tokens[i : i + batch_size]
        width = max(len(p) for p in prompts)
        input_ids = [[pad_id] * (width - len(p)) + p for p in prompts]  # left padding
        attention_mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=[], pad_token_id=pad_id
        )
        out = model.generate(
            input_ids=torch.tensor(input_ids, device=model.device),
            attention_mask=torch.tensor(attention_mask, device=model.device),
            generation_config=config,
        )
        outputs.extend(row[width : width + n].tolist() for row, n in zip(out, max_tokens))
        positions += len(prompts) * (width + max(max_tokens))
    wall = time.perf_counter() - t0
    useful = sum(map(len, workload.prompts)) + workload.useful_tokens
    note = f"batch {batch_size}, left-padded: runs {positions / useful:.2f}x the token positions of the engine"
    return RunResult("HF static", wall, workload.useful_tokens, outputs, note)


@torch.inference_mode()
def run_hf_continuous(model, workload: Workload, max_batch_tokens: int, progress: bool) -> RunResult:
    """transformers' continuous batching; requests are added one by one with their own
    max_new_tokens (`generate_batch` takes a single max_new_tokens for the whole batch)."""
    from transformers import ContinuousBatchingConfig

    page_size = 256
    num_pages = sum(-(-(len(p) + n) // page_size) for p, n in zip(workload.prompts, workload.max_tokens))
    cb_config = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_pages + 1, max_batch_tokens=max_batch_tokens
    )
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(workload.max_tokens))
    results = {}
    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=30
    ) as manager:
        t0 = time.perf_counter()
        ids = [
            manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
            for p, n in zip(workload.prompts, workload.max_tokens)
        ]
        with tqdm(total=len(ids), desc="HF continuous", unit="req", disable=not progress, leave=False) as bar:
            while len(results) < len(ids):
                result = manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError("HF continuous batching produced nothing for 60 s")
                if result.is_finished():
                    results[result.request_id] = result
                    bar.update(1)
        wall = time.perf_counter() - t0
    outputs = [list(results[rid].generated_tokens)[:n] for rid, n in zip(ids, workload.max_tokens)]
    return RunResult("HF continuous", wall, workload.useful_tokens, outputs, "per-request max_new_tokens")


@torch.inference_mode()
def hf_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Unpadded batch-of-one greedy generate: the ground truth for the engine."""
    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=[], pad_token_id=0)
    out = model.generate(torch.tensor([prompt], device=model.device), generation_config=config)
    return out[0, len(prompt) :].tolist()


# -- report -------------------------------------------------------------------------------------
def agreement(result: RunResult, reference: RunResult) -> str:
    same = sum(a == b for a, b in zip(result.outputs, reference.outputs))
    return f"{same}/{len(reference.outputs)}"


def report(results: list[RunResult], kv: KVStats, timer: PartTimer, targets: dict[str, float]) -> str:
    engine, num_steps = results[0], timer.calls["schedule"]
    lines = [
        "| system | useful tok/s | wall s | useful tokens | engine speed-up | target | outputs = engine | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        speedup = engine.tokens_per_s / r.tokens_per_s
        target = targets.get(r.name)
        verdict = "" if target is None else f">= {target:g}x {'met' if speedup >= target else 'MISSED'}"
        lines.append(
            f"| {r.name} | {r.tokens_per_s:,.1f} | {r.wall_s:.2f} | {r.useful_tokens} | {speedup:.2f}x "
            f"| {verdict} | {agreement(r, engine)} | {r.note} |"
        )
    block_bytes = kv.pool_bytes // kv.num_blocks
    waste = kv.peak_wasted_slots / max(kv.peak_running, 1)  # tokens per running request
    lines += [
        "",
        "| engine KV cache | value |",
        "|---|---|",
        f"| pool | {kv.num_blocks} blocks x {kv.block_size} tokens = {kv.pool_bytes / 2**20:.1f} MiB "
        f"({block_bytes} B per block) |",
        f"| peak blocks used | {kv.peak_blocks_used} ({kv.peak_blocks_used / kv.num_blocks:.1%} of the pool), "
        f"{kv.peak_running} running requests |",
        f"| wasted at peak | {kv.peak_wasted_slots} slots = {waste:.1f} tokens per running request "
        f"({waste / kv.block_size:.2f} blocks; target < 1 block: {'met' if waste < kv.block_size else 'MISSED'}) |",
        "",
        f"| engine phase ({num_steps} steps) | total s | ms per step | share of wall |",
        "|---|---:|---:|---:|",
    ]
    t = timer.seconds
    phases = {
        "schedule": t["schedule"],
        "runner.prepare (flat batch, block tables, slot mapping)": t["prepare"],
        "forward: attention": t["attention"],
        "forward: RoPE and store_kvcache": t["rotate_and_store"],
        "forward: the rest (linears, norms, lm_head)": (
            t["run"] - t["prepare"] - t["attention"] - t["rotate_and_store"]
        ),
        "sample (the sampler: penalties, probabilities, draws)": t["sample"],
        "wait for the step's tokens (host waits)": t["wait"],
        "outputs (append, stop checks, detokenize)": t["outputs"],
    }
    phases["outside these (step loop, sampling metadata, read-back)"] = engine.wall_s - sum(phases.values())
    for name, s in phases.items():
        lines.append(f"| {name} | {s:.2f} | {1e3 * s / num_steps:.2f} | {s / engine.wall_s:.0%} |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="existing HF checkpoint directory (default: write a random Llama)")
    add_model_and_workload_arguments(p)
    p.add_argument("--num-requests", type=int, help="default 64 (16 with --quick)")
    p.add_argument("--max-prompt", type=int, help="default 256 (128 with --quick)")
    p.add_argument("--max-tokens", type=int, help="default 128 (48 with --quick)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="HF static batch size")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine: running requests at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="tokens per step (engine, HF continuous)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default="auto")
    p.add_argument("--num-verify", type=int, default=4, help="requests checked against unpadded HF generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per system, interleaved; fastest kept")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's); 1 is steadier on a busy CPU")
    p.add_argument("--quick", action="store_true", help="fewer requests, shorter prompts and outputs")
    p.add_argument("--skip-hf", action="store_true", help="engine only (still verified)")
    p.add_argument("--profile", type=Path, help="cProfile the engine's timed run into this file and print the top")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()
    for name, full, quick in (("num_requests", 64, 16), ("max_prompt", 256, 128), ("max_tokens", 128, 48)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


@dataclass(slots=True)
class EngineRun:
    result: RunResult
    kv: KVStats
    timer: PartTimer
    attention_backend: str


def timed_engine_run(
    config: EngineConfig, workload: Workload, warmup: Workload, progress: bool, profiler: cProfile.Profile | None
) -> EngineRun:
    """A fresh engine each time, so that no run finds an earlier run's prompts in its prefix cache."""
    engine = LLMEngine(config)
    bytes_per_block = sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_caches) // engine.num_blocks
    kv = KVStats(engine.num_blocks, config.block_size, bytes_per_block * engine.num_blocks)
    run_engine(engine, warmup, progress=False)
    engine.peak_blocks_used = 0
    timer = PartTimer(device=engine.device)
    instrument(engine, timer, kv)
    with profiler or contextlib.nullcontext():
        result = run_engine(engine, workload, progress)
    assert engine.peak_blocks_used == kv.peak_blocks_used, (engine.peak_blocks_used, kv.peak_blocks_used)
    return EngineRun(result, kv, timer, engine.attention.name)


def main() -> None:
    args = parse_args()
    progress = not args.no_progress
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_random_llama(Path(tmp), args)
        config = EngineConfig(
            model=str(model_dir), device=str(device), block_size=args.block_size, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads or 0, seed=args.seed,
        )

        def load_hf():
            dtype = TORCH_DTYPES[config.dtype]
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
            return model.to(device).eval()

        hf = load_hf()
        hf_cb = load_hf()  # continuous batching switches its model's attention implementation
        pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id or 0
        workload = make_workload(args.num_requests, hf.config.vocab_size, args, args.seed)
        warmup = make_workload(4, hf.config.vocab_size, args, args.seed + 1)
        warmup.max_tokens = [8] * len(warmup.max_tokens)
        if not args.skip_hf:
            run_hf_static(hf, warmup, args.hf_batch_size, pad_id, progress=False)
            run_hf_continuous(hf_cb, warmup, args.max_num_batched_tokens, progress=False)

        profiler = cProfile.Profile() if args.profile else None
        engine_runs: list[EngineRun] = []
        hf_runs: dict[str, list[RunResult]] = defaultdict(list)
        for _ in range(args.repeats):  # systems interleaved, so that a busy spell hits them alike
            first = not engine_runs
            engine_runs.append(timed_engine_run(config, workload, warmup, progress, profiler if first else None))
            if not args.skip_hf:
                hf_runs["static"].append(run_hf_static(hf, workload, args.hf_batch_size, pad_id, progress))
                hf_runs["continuous"].append(
                    run_hf_continuous(hf_cb, workload, args.max_num_batched_tokens, progress)
                )
        best = min(engine_runs, key=lambda r: r.result.wall_s)
        results = [best.result] + [min(runs, key=lambda r: r.wall_s) for runs in hf_runs.values()]

        checked = range(min(args.num_verify, len(workload.prompts)))
        mismatched = [
            i for i in checked
            if hf_reference(hf, workload.prompts[i], workload.max_tokens[i]) != best.result.outputs[i]
        ]

    a = hf.config
    print(
        f"\nmodel: {args.model or 'random Llama'} (hidden {a.hidden_size}, {a.num_hidden_layers} layers, "
        f"{a.num_attention_heads} heads, {a.num_key_value_heads} KV heads, intermediate {a.intermediate_size}, "
        f"vocab {a.vocab_size}, {config.dtype}) on {device}; engine attention backend {best.attention_backend}; "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        f"workload: {len(workload.prompts)} requests, prompts {args.min_prompt}-{args.max_prompt} tokens "
        f"({sum(map(len, workload.prompts))} in all), max_tokens {args.min_tokens}-{args.max_tokens} "
        f"({workload.useful_tokens} in all), greedy, EOS ignored, seed {args.seed}; "
        f"fastest of {args.repeats} run(s) per system\n"
    )
    print(report(results, best.kv, best.timer, {"HF static": 3.0, "HF continuous": 6.0}))
    mark = "✓" if not mismatched else "✗"
    num_equal = len(checked) - len(mismatched)
    print(
        f"\n{mark} engine greedy outputs equal unpadded HF generate for {num_equal}/{len(checked)} requests"
        + (f" (mismatch: {mismatched})" if mismatched else "")
    )
    if profiler:
        profiler.dump_stats(args.profile)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    if mismatched:
        sys.exit(1)


if __name__ == "__main__":
    main()
