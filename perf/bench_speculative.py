"""Speculative decoding on the default pair: tokens/s with and without speculation, side by side.

For each batch size and temperature, the same code prompts (held out of training) run through the
engine with: no speculation, the draft model at a fixed k, the draft model with adaptive k, and
the n-gram proposer with adaptive k (optionally a second engine without speculation, whose ratio
shows the measurement's own noise). Printed per row: generated tokens/s, speedup over no
speculation in the same run, the share of request-steps that speculated, acceptance rate, mean
tokens per verification step, and the speedup S(k) = (1 - a^(k+1)) / ((1 - a)(k c + 1))
predicts from the measured a and c.

    python -m perf.bench_speculative                  # batch 1, 32, 64; T = 0 and 0.7; 3 rounds
    python -m perf.bench_speculative --batch-sizes 1 --max-tokens 64
    python -m perf.bench_speculative --max-tokens 64 --repeats 7 \
        --methods none "none, 2nd engine" "draft k=3" "draft adaptive" "ngram adaptive"
    python -m perf.spec_pair /tmp/pair --shape 1b --acceptance 0.7 && python -m perf.bench_speculative \
        --target /tmp/pair/target --draft /tmp/pair/draft --draft-dtype bfloat16 --temperatures 0 \
        --batch-sizes 1 8 64 256 --async-scheduling on --num-kv-blocks 4000 --repeats 1   # on a GPU
    python -m perf.bench_speculative --target model_repository/llm_engine/1/target \
        --eagle model_repository/llm_engine/1/eagle --dtype float32 --prompts chat --batch-sizes 1 \
        --methods none "eagle k=2" "eagle adaptive" --torch-matmul-too   # with and without oneDNN's copies
    python -m perf.bench_speculative --target model_repository/llm_engine/1/target \
        --eagle model_repository/llm_engine/1/eagle --dtype float32 --prompts chat --temperatures 0.7 \
        --batch-sizes 1 32 --methods none "eagle k=3" --unseeded-too --repeats 1  # keyed vs rejection sampling
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams
from perf.prompts import TINY_PAIR, chat_prompts, code_prompts

METHODS = {  # name -> engine knobs
    "none": dict(speculative_method="none"),
    "none, 2nd engine": dict(speculative_method="none"),  # the same work again: the measurement's noise
    "draft k=3": dict(speculative_method="draft", num_speculative_tokens=3, adaptive_speculation=False),
    "draft adaptive": dict(speculative_method="draft", num_speculative_tokens=4, adaptive_speculation=True),
    "ngram adaptive": dict(speculative_method="ngram", num_speculative_tokens=4, adaptive_speculation=True),
    # an EAGLE head (--eagle) on the target's hidden states
    "eagle k=1": dict(speculative_method="eagle", num_speculative_tokens=1, adaptive_speculation=False),
    "eagle k=2": dict(speculative_method="eagle", num_speculative_tokens=2, adaptive_speculation=False),
    "eagle k=3": dict(speculative_method="eagle", num_speculative_tokens=3, adaptive_speculation=False),
    "eagle adaptive": dict(speculative_method="eagle", num_speculative_tokens=4, adaptive_speculation=True),
}


def run(engine: LLMEngine, prompts, max_tokens: int, temperature: float, batch_size: int,
        seeded: bool = True) -> tuple[float, int]:
    """Keep `batch_size` requests in flight until all prompts are done, each seeded (its drafts
    verified against its keyed samples) or not (rejection sampling); returns (seconds, tokens)."""
    pending = list(prompts)
    in_flight = 0
    tokens = 0
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < batch_size:
            seed = len(pending) if seeded else None
            engine.add_request(pending.pop(), SamplingParams(
                max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True))
            in_flight += 1
        for out in engine.step():
            tokens += len(out.token_ids)
            in_flight -= out.finished
    return time.perf_counter() - started, tokens


def measure_c(engine: LLMEngine) -> float:
    tc, dc = engine.speculator.control.target_cost, engine.speculator.control.draft_cost
    return dc(1) / tc(1) if tc.ready and dc.ready else float("nan")


def measured_costs(engine: LLMEngine) -> dict[str, dict[int, list[float]]]:
    """The forwards' seconds the engine's speculation control measured, by size (the target's and
    a first draft forward's in tokens, a further draft forward's in requests): the costs it plans with."""
    control = engine.speculator.control
    return {name: {n: list(seconds) for n, seconds in sorted(cost.samples.items())}
            for name, cost in (("target", control.target_cost), ("draft_first", control.draft_first_cost),
                               ("draft", control.draft_cost))}


def verification_counts(engine: LLMEngine) -> tuple[int, int]:
    """(request-steps that verified at least one draft token, those that accepted all k) so far;
    the second only means something at a fixed k."""
    spec = engine.speculator
    if not spec.proposed_per_position:
        return 0, 0
    return spec.proposed_per_position[0], spec.accepted_per_position[engine.config.num_speculative_tokens - 1]


def speedup(a: float, k: int, c: float) -> float:
    """S(k) = (1 - a^(k+1)) / ((1 - a)(k c + 1)): tokens per verification over its cost in target
    forwards, for an acceptance rate a per draft token (clipped below 1) and draft cost ratio c."""
    a = min(max(a, 0.0), 0.98)
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))


def geometric_acceptance(accepted: int, steps: int, all_accepted: int) -> float:
    """The per-token acceptance S(k) assumes (each draft token accepted independently): every
    step is a run of accepted tokens ended by one rejection, unless all k passed."""
    trials = accepted + steps - all_accepted
    return accepted / trials if trials else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--requests-per-slot", type=int, default=2, help="requests = batch size x this (min 4)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds; each runs every method once, starting one method later than the round before, so load "
                    "drifting on a shared host hits all alike")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is steadiest on a shared CPU)")
    ap.add_argument("--dtype", default="bfloat16", help="target weights and KV")
    ap.add_argument("--draft-dtype", default="float32", help="draft weights and KV (a tiny draft is faster in "
                    "float32 on a CPU)")
    # the tiny pair until the default model (SmolLM2) has a draft of its own
    ap.add_argument("--target", type=Path, default=TINY_PAIR / "target", help="target checkpoint (default: %(default)s)")
    ap.add_argument("--draft", type=Path, default=TINY_PAIR / "draft", help="draft checkpoint (default: %(default)s)")
    ap.add_argument("--eagle", type=Path, nargs="+", default=[],
                    help="EAGLE heads for the target (the eagle methods; with several, each eagle method runs once "
                         "per head, labelled by the head's directory name)")
    ap.add_argument("--kv-cache-mib", type=int, default=512,
                    help="each engine's KV pool, draft included (default: what llm_engine's config.pbtxt serves). "
                    "A head's or draft's KV takes a share of it, so a pool too small for the batch preempts "
                    "(re-prefills) more often with speculation than without: the preempted column says so")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="each engine's KV blocks (on CUDA, where the pool is otherwise a share of the GPU's memory and "
                    "the engines built after the first would find no room)")
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                    help="overlapped steps: auto is the engine's default (on CUDA without speculation only)")
    ap.add_argument("--prompts", choices=("code", "chat"), default="code",
                    help="held-out code continuations (64-192 tokens), or the held-out chat requests in the chat template")
    ap.add_argument("--torch-matmul-too", action="store_true",
                    help="on a CPU in float32, each method also runs on an engine whose linear layers keep torch's "
                    "matmul at every row count (cpu_weight_copies false, see perf/bench_cpu_linears.py), labelled so")
    ap.add_argument("--methods", nargs="+", default=[m for m, knobs in METHODS.items() if m != "none, 2nd engine"
                                                     and knobs["speculative_method"] != "eagle"],
                    choices=list(METHODS),
                    help="the first is the baseline of every ratio")
    ap.add_argument("--quantization", default="none", help="the target's weights: none, int8, int4 (engine parameter)")
    ap.add_argument("--compile-decode", action="store_true", help="CPU: decode steps compiled (compile_decode)")
    ap.add_argument("--compile-prefill", action="store_true",
                    help="CPU: prefill and verification steps compiled (compile_prefill)")
    ap.add_argument("--costs-json", type=Path, default=None,
                    help="write each speculating engine's measured forward costs (seconds by size) here, by label")
    ap.add_argument("--unseeded-too", action="store_true",
                    help="each method also with unseeded requests (rejection sampling from the engine's stream, "
                         "where seeded requests verify against their keyed samples), labelled so")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    runs = {}  # label -> (method, draft)
    for name in args.methods:
        if METHODS[name]["speculative_method"] != "eagle":
            runs[name] = (name, args.draft)
        for head in args.eagle if METHODS[name]["speculative_method"] == "eagle" else ():
            runs[name if len(args.eagle) == 1 else f"{name} ({head.name})"] = (name, head)
    if args.torch_matmul_too:
        runs |= {f"{label}, torch matmul": method_and_draft for label, method_and_draft in runs.items()}
    if args.unseeded_too:
        runs |= {f"{label}, unseeded": method_and_draft for label, method_and_draft in runs.items()}
    labels = list(runs)
    engines = {}
    for label, (name, draft) in runs.items():
        engines[label] = LLMEngine(EngineConfig(
            model=str(args.target), draft_model=str(draft), num_threads=args.threads,
            max_num_seqs=max(args.batch_sizes), dtype=args.dtype, draft_dtype=args.draft_dtype,
            kv_cache_memory_bytes=args.kv_cache_mib * 2**20, num_kv_blocks=args.num_kv_blocks,
            async_scheduling=None if args.async_scheduling == "auto" else args.async_scheduling == "on",
            cpu_weight_copies=", torch matmul" not in label, quantization=args.quantization,
            compile_decode=args.compile_decode, compile_prefill=args.compile_prefill, **METHODS[name]))
    rows = []
    cases = [(b, t) for b in args.batch_sizes for t in args.temperatures]
    bar = tqdm(total=len(cases) * len(labels) * args.repeats, desc="runs")
    for batch_size, temperature in cases:
        n = max(4, batch_size * args.requests_per_slot)
        prompts = (chat_prompts(tokenizer, n, seed=batch_size) if args.prompts == "chat"
                   else code_prompts(tokenizer, n, 64, 192, seed=batch_size))
        for engine in engines.values():
            run(engine, prompts[:2], 8, temperature, 2)  # warm-up
        rates = {name: [] for name in labels}
        ratios = {name: [] for name in labels}
        # draft tokens, accepted, verification steps, steps that accepted all k, tokens generated, preemptions
        spec = {name: [0, 0, 0, 0, 0, 0] for name in labels}
        for round_index in range(args.repeats):
            # each round starts one method later: every method runs early and late in a round as
            # often, so load drifting within a round favours none of them
            shift = round_index % len(labels)
            for name in labels[shift:] + labels[:shift]:
                engine = engines[name]
                # a few steps of the same load first: memory the last engine's run left in another
                # shape is faulted in again here, not in the timed run (it cost the engine that ran
                # after a different one a few percent)
                seeded = not name.endswith(", unseeded")
                run(engine, prompts[:batch_size], 4, temperature, batch_size, seeded)
                s0, (steps0, full0) = engine.stats(), verification_counts(engine)
                seconds, tokens = run(engine, prompts, args.max_tokens, temperature, batch_size, seeded)
                s1, (steps1, full1) = engine.stats(), verification_counts(engine)
                spec[name][0] += s1.spec_draft_tokens_total - s0.spec_draft_tokens_total
                spec[name][1] += s1.spec_accepted_tokens_total - s0.spec_accepted_tokens_total
                spec[name][2] += steps1 - steps0
                spec[name][3] += full1 - full0
                spec[name][4] += tokens
                spec[name][5] += s1.num_preemptions_total - s0.num_preemptions_total
                rates[name].append(tokens / seconds)
                bar.update()
            for name in labels:
                ratios[name].append(rates[name][-1] / rates[labels[0]][-1])
        for name in labels:
            engine = engines[name]
            draft, accepted, steps, all_accepted, generated, preempted = spec[name]
            # request-steps that verified drafts, of all request-steps (each plain one yields a token)
            share = steps / (generated - accepted) if generated > accepted else float("nan")
            a = accepted / draft if draft else float("nan")
            k = engine.config.num_speculative_tokens if not engine.config.adaptive_speculation else None
            c = measure_c(engine)
            a_geo = geometric_acceptance(accepted, steps, all_accepted)
            predicted = speedup(a_geo, k, c) if k and draft and c == c else float("nan")
            rows.append((batch_size, temperature, name, statistics.median(rates[name]), statistics.median(ratios[name]),
                         min(ratios[name]), max(ratios[name]), share, a, accepted / steps + 1 if steps else 1.0, predicted, c,
                         preempted / args.repeats))
        for row in rows[-len(labels):]:  # as each case ends: a run cut short keeps what it measured
            tqdm.write(" | ".join(format(x, ".3g") if isinstance(x, float) else str(x) for x in row))
        if args.costs_json is not None:  # after each case, so that a run cut short keeps what it measured
            args.costs_json.write_text(json.dumps({label: measured_costs(engine) for label, engine in engines.items()
                                                   if engine.speculator.proposer is not None}))
    bar.close()
    where = "the held-out chat requests" if args.prompts == "chat" else "prompts 64-192 tokens of held-out code"
    print(f"\n{args.target.name}, {args.max_tokens} new tokens per request, {where}, "
          f"target {args.dtype} (quantization {args.quantization}, compile_decode {args.compile_decode}, "
          f"compile_prefill {args.compile_prefill}), draft {args.draft_dtype}, {args.threads} torch thread(s), KV pool {args.kv_cache_mib} MiB, "
          f"overlapped steps {args.async_scheduling}, "
          f"median of {args.repeats} interleaved rounds (vs first method in the same round)\n")
    print("acceptance: accepted / drafted tokens. S(k) predicted (fixed k): the formula with the per-token rate it\n"
          "assumes (accepted / (accepted + rejections)) and c = a further draft forward / a target forward.\n")
    print("speculating: share of request-steps that verified draft tokens. preempted: preemptions per timed run.\n")
    print("| batch | T | method | tok/s | vs none | range | speculating | acceptance | tokens/verify step | "
          "S(k) predicted | c | preempted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for b, t, name, rate, ratio, lo, hi, share, a, mean_len, pred, c, preempted in rows:
        fmt = lambda x, f: "-" if x != x else format(x, f)  # noqa: E731
        print(f"| {b} | {t} | {name} | {rate:.1f} | {ratio:.2f}x | {lo:.2f}-{hi:.2f} | {share:.0%} | {fmt(a, '.2f')} | "
              f"{mean_len:.2f} | {fmt(pred, '.2f')} | {fmt(c, '.2f')} | {preempted:.1f} |")


if __name__ == "__main__":
    main()
