"""End to end on one GPU: a random-weight Llama-3.2-1B shape in bf16, this engine beside HF.

Measured in one run:
  - batch-1 decode latency (ms per token after a 512-token prompt): the engine with CUDA graphs,
    the engine eager, and HF `generate`; against the weight-read floor (weight bytes / HBM
    bandwidth, 0.58 ms/token for 2.47 GB at 4.25 TB/s);
  - throughput on 256 mixed requests (prompts 128-1024 tokens, 32-256 new tokens each, greedy,
    EOS ignored): generated tokens/s for the engine; HF `generate` in static batches of 32 on a
    subset, counting useful tokens only (its full run takes minutes).
Greedy tokens of the engine are checked against HF's on a few prompts first (bf16: the first
tokens must agree; a fast wrong engine is a bug).

    python -m perf.bench_gpu                 # the 1B shape (CUDA)
    python -m perf.bench_gpu --shape 8b --default-only   # Llama-3.1-8B shape: the default engine and HF
    python -m perf.bench_gpu --tiny          # a tiny shape, runs on CPU too (a smoke run)
    python -m perf.bench_gpu --default-only --quantization fp8   # + the default engine with FP8 weights

With --quantization fp8 the default engine runs a second time with FP8 weights (quantized at load
from the same checkpoint), and a table sets both side by side: batch-1 ms/token and tok/s against
each one's floor (its own weight bytes over the HBM bandwidth), and how many of the FP8 engine's
greedy tokens on the check prompts equal the bf16 engine's.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import traceback
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams
from perf.harness import sync
from perf.random_checkpoints import SHAPE_1B, SHAPE_8B, SHAPE_TINY, write_model

SHAPES = {"1b": SHAPE_1B, "8b": SHAPE_8B}


def model_bytes(model) -> int:
    """Bytes of the model's weights as the engine holds them (parameters and buffers: FP8 weights and
    their scales), the rotary tables left out."""
    return sum(t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]
               if "rotary" not in name)


def same_greedy_tokens(engine: LLMEngine, prompts: list[list[int]], reference: dict) -> str:
    """How many of `reference`'s greedy tokens (8 per prompt, by request in order) this engine gives."""
    got: dict = {}
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    pairs = list(zip(got.values(), reference.values()))
    return f"{sum(a == b for mine, ref in pairs for a, b in zip(mine, ref))}/{sum(len(ref) for _, ref in pairs)}"


def engine_decode_latency(engine: LLMEngine, prompt: list[int], new_tokens: int, times=None) -> float:
    """Seconds per output token after the first (the prefill step is excluded)."""
    engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill, first token
    sync(engine.device)
    step = times.step if times is not None else engine.step
    started = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        step()
        steps += 1
    sync(engine.device)
    return (time.perf_counter() - started) / steps


def kernel_table(engine: LLMEngine, prompts: list[list[int]], steps: int = 32) -> str:
    """GPU kernels of `steps` decode steps of len(prompts) requests (torch.profiler), by time."""
    from torch.profiler import ProfilerActivity, profile

    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # prefill
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync(engine.device)
    while engine.has_unfinished_requests():
        engine.step()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count >= steps]
    kernels.sort(key=lambda e: -e.device_time_total)
    total_us = sum(e.device_time_total for e in kernels) / steps
    lines = [f"batch {len(prompts)}: {sum(e.count for e in kernels) / steps:.0f} kernels, {total_us:.0f} us of GPU "
             f"time per step (kernels run at least once a step)", "| kernel | per step | us per step |", "|---|---|---|"]
    for e in kernels[:15]:
        lines.append(f"| {e.key[:70]} | {e.count / steps:.1f} | {e.device_time_total / steps:.1f} |")
    return "\n".join(lines)


def hf_decode_latency(model, prompt: list[int], new_tokens: int, device) -> float:
    ids = torch.tensor([prompt], device=device)
    def timed(n):
        sync(device)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync(device)
        return time.perf_counter() - t
    timed(2)
    return (timed(new_tokens) - timed(1)) / (new_tokens - 1)


class StepTimes:
    """Where a run's time goes, step by step: wall time of each `engine.step()` and, on CUDA, the
    GPU time of its forward (events around the runner's call, read after the run, so timing adds
    no synchronisation). Steps are split into decode-only ones and those holding prompt tokens."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.steps: list[tuple[bool, int, int, float, object, object]] = []
        self._events = self._batch = None
        run = engine.runner.run

        def timed_run(step):
            if engine.device.type != "cuda":
                return run(step)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = run(step)
            end.record()
            self._events = (start, end)
            return out

        engine.runner.run = timed_run
        schedule = engine.scheduler.schedule

        def kept_schedule(*args, **kwargs):
            self._batch = schedule(*args, **kwargs)
            return self._batch

        engine.scheduler.schedule = kept_schedule

    def step(self) -> list:
        started = time.perf_counter()
        self._events = self._batch = None
        outputs = self.engine.step()
        wall = time.perf_counter() - started
        counts = self._batch.num_scheduled_tokens if self._batch is not None else []
        start, end = self._events or (None, None)
        self.steps.append((all(n == 1 for n in counts), len(counts), sum(len(o.token_ids) for o in outputs),
                           wall, start, end))
        return outputs

    def summary(self) -> dict:
        sync(self.engine.device)
        rows = {}
        for kind in (True, False):
            steps = [s for s in self.steps if s[0] == kind]
            if not steps:
                continue
            gpu = [s[4].elapsed_time(s[5]) / 1e3 for s in steps if s[4] is not None]
            rows["decode" if kind else "with prompt tokens"] = dict(
                steps=len(steps), wall_s=sum(s[3] for s in steps), gpu_forward_s=sum(gpu),
                mean_requests=sum(s[1] for s in steps) / len(steps), tokens_out=sum(s[2] for s in steps))
        return rows


def engine_throughput(engine: LLMEngine, prompts, max_tokens, times: StepTimes | None = None) -> tuple[float, int]:
    for p, m in zip(prompts, max_tokens):
        engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
    sync(engine.device)
    step = times.step if times is not None else engine.step
    started = time.perf_counter()
    generated = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.token_ids) for o in step())
    sync(engine.device)
    return time.perf_counter() - started, generated


def hf_static_throughput(model, prompts, max_tokens, batch_size, device) -> tuple[float, int]:
    started = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), batch_size):
        batch, news = prompts[i : i + batch_size], max_tokens[i : i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        model.generate(ids, attention_mask=mask, max_new_tokens=max(news), min_new_tokens=max(news),
                       do_sample=False, pad_token_id=0)
        useful += sum(news)
    sync(device)
    return time.perf_counter() - started, useful


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shape (smoke run; CPU works)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="random-weight Llama shape (CUDA)")
    ap.add_argument("--default-only", action="store_true",
                    help="measure the default engine (overlapped steps) and HF only: no eager or plain-step engine")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="each engine's KV blocks on CUDA (default: 24,000 at 1B, 12,000 at 8B: room for two engines)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--hf-requests", type=int, default=64, help="HF static batches run on this many")
    ap.add_argument("--hbm-tbps", type=float, default=4.25)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="the engines' token budget per step (prompt chunks and decodes together)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--quantization", choices=["fp8", "int8", "int4"], default=None,
                    help="also run the default engine with these weights, side by side with the float one")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPE_TINY if args.tiny else SHAPES[args.shape]
    name = "tiny" if args.tiny else {"1b": "3.2-1B", "8b": "3.1-8B"}[args.shape]
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    results: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama"
        weight_bytes = write_model(model_dir, shape, device)
        floor_ms = weight_bytes / (args.hbm_tbps * 1e12) * 1e3
        results["weight_bytes"] = weight_bytes
        rng = random.Random(0)
        vocab = shape["vocab_size"]
        n = args.num_requests if not args.tiny else min(args.num_requests, 32)
        prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(128, 1024))] for _ in range(n)]
        max_tokens = [rng.randint(32, 256) for _ in range(n)]
        prompt512 = [rng.randrange(2, vocab) for _ in range(512)]

        hf = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=getattr(torch, dtype)).to(device).eval()
        hf.generation_config.eos_token_id = None

        # a fixed pool (blocks for every request's whole context, plus slack) so that two engines fit
        knobs = dict(model=str(model_dir), dtype=dtype, max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens,
                     num_kv_blocks=(args.num_kv_blocks or (12000 if args.shape == "8b" else 24000))
                     if device.type == "cuda" else None, kv_cache_memory_bytes=2**30)
        t = time.perf_counter()
        try:
            engine = LLMEngine(EngineConfig(**knobs, async_scheduling=True))
        except Exception:  # keep measuring what can be measured
            traceback.print_exc()
            results["cuda_graphs"] = "capture failed; eager"
            engine = LLMEngine(EngineConfig(**knobs, async_scheduling=True, enforce_eager=True))
        results["engine_startup_s"] = time.perf_counter() - t
        results["small_batch_linears"] = {  # the startup tuner's choice per weight shape (out x in)
            f"{out}x{inp}": {"gemv_max_rows": c["gemv_max_rows"],
                             "us (torch, gemv) by rows": {rows: [round(t * 1e6, 1) for t in pair]
                                                          for rows, pair in c["seconds (torch, gemv) by rows"].items()}}
            for (out, inp), c in engine.linear_choices.get("target", {}).items()
            if "gemv_max_rows" in c  # (a CPU's choices are of other kernels)
        }

        # correctness first: greedy tokens agree with HF on a few prompts
        check = prompts[:4]
        for p in check:
            engine.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        got: dict = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.token_ids)
        agree = 0
        with torch.no_grad():
            for p, toks in zip(check, got.values()):
                ref = hf.generate(torch.tensor([p], device=device), max_new_tokens=8, do_sample=False)[0, len(p):]
                agree += int(ref[0]) == toks[0]
        results["first_token_agreement"] = f"{agree}/{len(check)}"

        with torch.no_grad():
            hf_ms = hf_decode_latency(hf, prompt512, 64, device) * 1e3
        eager_ms = float("nan")
        if not args.default_only:
            eager = LLMEngine(EngineConfig(**knobs, enforce_eager=True)) if device.type == "cuda" else engine
            engine_decode_latency(eager, prompt512, 16)
            eager_ms = engine_decode_latency(eager, prompt512, 128) * 1e3
            del eager
        results.update(hf_ms_per_token=hf_ms, engine_eager_ms_per_token=eager_ms, floor_ms_per_token=floor_ms)

        # the default (steps overlapped with the GPU on CUDA) beside plain steps, same prompts
        modes = {"overlapped steps": engine}
        if not args.default_only:
            modes["plain steps"] = LLMEngine(EngineConfig(**knobs, async_scheduling=False))
        quantized_label = f"overlapped steps, {args.quantization}"
        if args.quantization:
            quantized = LLMEngine(EngineConfig(**knobs, async_scheduling=True, quantization=args.quantization))
            modes[quantized_label] = quantized
            results[quantized_label + " weight_bytes"] = model_bytes(quantized.model)
            results[quantized_label + " greedy tokens equal to the float engine"] = \
                same_greedy_tokens(quantized, check, got)
        for label, e in modes.items():
            times = StepTimes(e)
            engine_decode_latency(e, prompt512, 16)  # warm-up
            times.steps.clear()
            ms = engine_decode_latency(e, prompt512, 128, times) * 1e3
            batch1_gpu_ms = times.summary()["decode"]["gpu_forward_s"] / len(times.steps) * 1e3
            engine_throughput(e, prompts[:8], [8] * 8)  # warm-up
            times.steps.clear()
            seconds, generated = engine_throughput(e, prompts, max_tokens, times)
            results[label] = dict(ms_per_token=ms, batch1_gpu_forward_ms=batch1_gpu_ms, tok_s=generated / seconds,
                                  generated=generated, seconds=seconds, peak_blocks_used=e.peak_blocks_used,
                                  num_blocks=e.num_blocks, step_times=times.summary())
        if device.type == "cuda":
            try:
                results["kernels"] = "\n\n".join(kernel_table(engine, batch) for batch in ([prompt512], prompts[:128]))
            except Exception:  # the profile explains; the figures above stand without it
                traceback.print_exc()
        modes_run = list(modes)
        del modes, e
        m = min(args.hf_requests, n)
        with torch.no_grad():
            hf_s, hf_useful = hf_static_throughput(hf, prompts[:m], max_tokens[:m], 32, device)
        results.update(hf_static_tok_s=hf_useful / hf_s, hf_static_requests=m)

    print(json.dumps(results, indent=1))
    best = results["overlapped steps"]
    print(f"\n{results['device']}, Llama {name} shape, random weights, {dtype}\n")
    print("| measure | engine, overlapped steps | engine, plain steps | engine eager | HF transformers | floor / target |")
    print("|---|---|---|---|---|---|")
    target_ms = 4.4 if args.shape == "8b" and not args.tiny else 1.5 * floor_ms  # 8B: 1.16x its floor
    plain = results.get("plain steps", dict(ms_per_token=float("nan"), tok_s=float("nan")))
    print(f"| batch-1 decode, ms/token (512-token prompt) | {best['ms_per_token']:.2f} | {plain['ms_per_token']:.2f} | "
          f"{eager_ms:.2f} | {hf_ms:.2f} | floor {floor_ms:.2f}, target <= {target_ms:.2f} |")
    print(f"| {n} mixed requests, generated tok/s | {best['tok_s']:,.0f} | {plain['tok_s']:,.0f} | | "
          f"{results['hf_static_tok_s']:,.0f} (static batches of 32, {m} requests) | target >= 30,000 at 1B |")
    for label in modes_run:
        r = results[label]
        print(f"\n{label}: batch-1 decode, GPU time of the forward {r['batch1_gpu_forward_ms']:.2f} ms of "
              f"{r['ms_per_token']:.2f} ms per step; the {n}-request run's {r['seconds']:.2f} s:")
        print("| steps | count | mean requests | tokens out | wall s | GPU forward s | GPU idle share |")
        print("|---|---|---|---|---|---|---|")
        for kind, k in r["step_times"].items():
            idle = 1 - k["gpu_forward_s"] / k["wall_s"] if k["gpu_forward_s"] else float("nan")
            print(f"| {kind} | {k['steps']} | {k['mean_requests']:.0f} | {k['tokens_out']:,} | {k['wall_s']:.2f} | "
                  f"{k['gpu_forward_s']:.2f} | {idle:.0%} |")
    if args.quantization:
        q = results[quantized_label]
        q_bytes = results[quantized_label + " weight_bytes"]
        q_floor = q_bytes / (args.hbm_tbps * 1e12) * 1e3
        equal = results[quantized_label + " greedy tokens equal to the float engine"]
        print(f"\n{args.quantization} weights beside {dtype} (the default engine, same prompts; greedy tokens equal to "
              f"the {dtype} engine's: {equal})\n")
        print(f"| weights | bytes | batch-1 ms/token | floor | over floor | {n} requests tok/s | vs float |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        print(f"| {dtype} | {weight_bytes / 1e9:.2f} GB | {best['ms_per_token']:.3f} | {floor_ms:.3f} | "
              f"{best['ms_per_token'] / floor_ms:.2f}x | {best['tok_s']:,.0f} | 1.00x |")
        print(f"| {args.quantization} | {q_bytes / 1e9:.2f} GB | {q['ms_per_token']:.3f} | {q_floor:.3f} | "
              f"{q['ms_per_token'] / q_floor:.2f}x | {q['tok_s']:,.0f} | {q['tok_s'] / best['tok_s']:.2f}x tok/s, "
              f"{best['ms_per_token'] / q['ms_per_token']:.2f}x batch 1 |")
    if "kernels" in results:
        print("\ndecode steps, GPU kernels (overlapped steps):\n" + results["kernels"])
    if results.get("small_batch_linears"):
        print("\nsmall-batch linears at startup (GPU us per call after an L2 flush, torch / Triton gemv):\n")
        print("| weight (out x in) | gemv up to rows | " + " | ".join(f"{r} rows" for r in (1, 2, 4, 8, 16)) + " |")
        print("|---|---|" + "---|" * 5)
        for shape, c in results["small_batch_linears"].items():
            cells = [f"{t[0]:.1f} / {t[1]:.1f}" for t in c["us (torch, gemv) by rows"].values()]
            print(f"| {shape} | {c['gemv_max_rows']} | " + " | ".join(cells + ["-"] * (5 - len(cells))) + " |")
    print(f"\nengine vs HF: {hf_ms / best['ms_per_token']:.1f}x lower latency, "
          f"{best['tok_s'] / results['hf_static_tok_s']:.1f}x throughput; first-token agreement with HF "
          f"{results['first_token_agreement']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
