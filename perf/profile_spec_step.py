"""Where a batch-1 speculative step's time goes, against a plain step: the target's forward (one
token, or the verification of k + 1), the EAGLE head's forwards part by part, sampling and the
engine's host work, summed per step, on the held-out chat and code requests in the chat template,
greedy, one request at a time. The head runs in each of `--draft-dtypes` (its checkpoint is
bfloat16, so a bfloat16 head multiplies by exactly its trained weights; its activations are what
it rounds). Every engine runs the same requests in each round, the rounds interleaved; wrapping
the parts adds a little time to each.

    python -m perf.profile_spec_step --threads 2 --k 2 --draft-dtypes float32 bfloat16
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams
from perf.harness import PartTimer, TimedSampler
from perf.prompts import DEFAULT_TARGET, chat_prompts

DEFAULT_HEAD = DEFAULT_TARGET.parent / "eagle"
HEAD_PARTS = [("head: fc", "fc"), ("head: qkv", "layer.self_attn.qkv_proj"), ("head: o", "layer.self_attn.o_proj"),
              ("head: gate_up", "layer.mlp.gate_up_proj"), ("head: down", "layer.mlp.down_proj"),
              ("head: lm_head", "lm_head")]


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[int, int, float]:
    """(steps, tokens, seconds) of the prompts one after another."""
    steps = tokens = 0
    started = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            tokens += sum(len(out.token_ids) for out in engine.step())
            steps += 1
    return steps, tokens, time.perf_counter() - started


def instrument(engine: LLMEngine) -> PartTimer:
    timer = PartTimer()
    timer.wrap(engine.runner.model, "forward", "target forward")
    engine.sampler = TimedSampler(engine, timer, "sampling and verification")
    if engine.speculator.proposer is not None:
        head = engine.speculator.proposer.runner.model
        for label, path in HEAD_PARTS:
            timer.wrap(head.get_submodule(path), "forward", label)
        timer.wrap(head, "forward", "head forwards (all of them)")
    return timer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    ap.add_argument("--eagle", type=Path, default=DEFAULT_HEAD)
    ap.add_argument("--k", type=int, default=2, help="draft tokens per verification (fixed)")
    ap.add_argument("--draft-dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=6, help="held-out requests per round")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    prompts = chat_prompts(tokenizer, args.requests, seed=3)
    common = dict(model=str(args.target), num_threads=args.threads, dtype="float32", max_num_seqs=4)
    engines = {"plain": LLMEngine(EngineConfig(**common, speculative_method="none"))}
    for dtype in args.draft_dtypes:
        engines[f"eagle k={args.k}, head {dtype}"] = LLMEngine(EngineConfig(
            **common, speculative_method="eagle", draft_model=str(args.eagle), draft_dtype=dtype,
            num_speculative_tokens=args.k, adaptive_speculation=False))
    timers = {}
    for engine in engines.values():
        generate(engine, prompts[:1], 8)  # warm-up
    for name, engine in engines.items():
        timers[name] = instrument(engine)
    totals = {name: [0, 0, 0.0] for name in engines}  # steps, tokens, seconds
    for round_index in range(args.rounds):
        names = list(engines)
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            steps, tokens, seconds = generate(engines[name], prompts, args.max_tokens)
            for i, value in enumerate((steps, tokens, seconds)):
                totals[name][i] += value

    labels = ["target forward", "head forwards (all of them)"] + [label for label, _ in HEAD_PARTS] + [
        "sampling and verification"]
    names = list(engines)
    print(f"\n{args.target.name} (float32) and {args.eagle.name}, batch 1, {args.requests} held-out requests x "
          f"{args.max_tokens} tokens, greedy, {args.rounds} interleaved rounds, {args.threads} torch thread(s); "
          "ms per step\n")
    print("| part | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for label in labels:
        cells = []
        for name in names:
            seconds = timers[name].seconds.get(label)
            cells.append("-" if seconds is None else f"{seconds / totals[name][0] * 1e3:.2f}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    rest = []
    for name in names:
        steps, _, seconds = totals[name]
        accounted = sum(timers[name].seconds.get(label, 0.0) for label in
                        ("target forward", "head forwards (all of them)", "sampling and verification"))
        rest.append(f"{(seconds - accounted) / steps * 1e3:.2f}")
    print("| engine host work (the rest) | " + " | ".join(rest) + " |")
    print("| the whole step | " + " | ".join(f"{s / n * 1e3:.2f}" for n, _, s in totals.values()) + " |")
    print("| tokens per step | " + " | ".join(f"{t / n:.2f}" for n, t, _ in totals.values()) + " |")
    plain_rate = totals["plain"][1] / totals["plain"][2]
    rates = [f"{t / s:.1f} ({t / s / plain_rate:.2f}x)" for _, t, s in totals.values()]
    print("| tok/s (vs plain) | " + " | ".join(rates) + " |")
    plain_step = totals["plain"][2] / totals["plain"][0]
    print("\nc, one head forward / a plain step: " + ", ".join(
        f"{name} {timers[name].seconds['head forwards (all of them)'] / (args.k * totals[name][0]) / plain_step:.3f}"
        for name in names[1:]))


if __name__ == "__main__":
    main()
