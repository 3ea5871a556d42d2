"""Agentic sessions on the default model, in process: plain decoding against n-gram, suffix and
EAGLE speculation.

Each session is an agent loop against a local environment (perf/agentic_env.py): code edits
(the whole file back each turn), JSON tool calls, or plain one-turn chat. Every turn re-sends the
whole conversation in the chat template, greedy (T = 0, so every configuration writes the same
text and the runs compare like with like). Sessions run concurrently; when a turn ends, the
environment answers at once and the session's next turn arrives.

Reported per configuration: output tokens/s; TTFT and ITL per turn, p50 and p99 (ITL: a turn's
(last token - first token) / (tokens - 1), genai-perf's); prefix-cache hits over reusable tokens
(a turn's reusable tokens: its longest prompt prefix that an earlier prompt, or prompt and
answer, on the engine held); accepted draft tokens per verification; engine CPU-seconds per million output tokens
(process CPU time spent in the engine's calls: every thread, torch's included).

    python -m perf.bench_agentic                              # code-edit and chat, 1 and 8 sessions
    python -m perf.bench_agentic --workloads code-edit tools --sessions 1 8 32 --out perf/results/agentic.md
"""
from __future__ import annotations

import argparse
import gc
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams
from perf import REPO_ROOT
from perf.agentic_env import WORKLOADS
from perf.harness import common_prefix
from perf.prompts import DEFAULT_TARGET

EAGLE_HEAD = REPO_ROOT / "model_repository" / "llm_engine" / "1" / "eagle"
CONFIGS = {  # name -> engine knobs (k is set from --k, the EAGLE head's from --eagle-k)
    "plain": dict(speculative_method="none"),
    "ngram": dict(speculative_method="ngram", adaptive_speculation=True),
    "suffix": dict(speculative_method="suffix", adaptive_speculation=True),
    "suffix k fixed": dict(speculative_method="suffix", adaptive_speculation=False),  # every draft the trees offer
    "eagle": dict(speculative_method="eagle", adaptive_speculation=True, draft_model=str(EAGLE_HEAD)),
}


@dataclass(slots=True)
class Turn:
    session: int
    prompt: list[int]
    reusable: int  # leading prompt tokens an earlier prompt + answer on this engine held
    added_at: float
    first_at: float | None = None
    last_at: float | None = None
    output: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RunResult:
    seconds: float
    turns: list[Turn]
    cpu_seconds: float  # in the engine's calls
    hit_tokens: int
    draft_tokens: int
    accepted_tokens: int
    verifications: int  # request-steps that verified at least one draft token

    @property
    def output_tokens(self) -> int:
        return sum(len(t.output) for t in self.turns)


class SessionRunner:
    """Runs sessions on one engine; remembers what the engine has seen (for reusable tokens)."""

    def __init__(self, engine: LLMEngine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer
        self.seen: list[list[int]] = []  # every prompt, and prompt + answer, this engine has served

    def reusable(self, prompt: list[int]) -> int:
        return max((common_prefix(prompt, s) for s in self.seen), default=0)

    def run(self, workload: str, num_sessions: int, seed: int, max_turns: int | None = None,
            max_tokens: int | None = None) -> RunResult:
        engine, tok = self.engine, self.tokenizer
        sessions = [WORKLOADS[workload](seed * 1000 + i) for i in range(num_sessions)]
        for s in sessions:
            if max_turns is not None and hasattr(s, "turns"):
                s.turns = min(s.turns, max_turns)
            if workload == "code-edit":  # room for the whole file again, and a little
                s.max_tokens = int(len(tok.encode(s.file)) * 1.25) + 32
            if max_tokens is not None:
                s.max_tokens = min(s.max_tokens, max_tokens)
        live: dict[str, Turn] = {}
        done: list[Turn] = []
        stats0, verifications0 = engine.stats(), engine.speculator.proposed_per_position[:1]
        cpu = 0.0

        def submit(i: int) -> None:
            nonlocal cpu
            prompt = tok.apply_chat_template(sessions[i].messages, add_generation_prompt=True, tokenize=False)
            ids = tok(prompt, add_special_tokens=False).input_ids
            turn = Turn(i, ids, self.reusable(ids), time.perf_counter())
            self.seen.append(ids)  # (a session beside it may reuse its prompt's blocks before it ends)
            c0 = time.process_time()
            rid = engine.add_request(ids, SamplingParams(max_tokens=sessions[i].max_tokens, temperature=0.0))
            cpu += time.process_time() - c0
            live[rid] = turn

        started = time.perf_counter()
        for i in range(num_sessions):
            submit(i)
        while engine.has_unfinished_requests():
            c0 = time.process_time()
            outputs = engine.step()
            cpu += time.process_time() - c0
            now = time.perf_counter()
            for out in outputs:
                turn = live[out.request_id]
                if out.token_ids:
                    turn.first_at = turn.first_at or now
                    turn.last_at = now
                    turn.output += out.token_ids
                if out.finished:
                    del live[out.request_id]
                    done.append(turn)
                    self.seen.append(turn.prompt + turn.output)
                    if sessions[turn.session].reply(tok.decode(turn.output, skip_special_tokens=True)):
                        submit(turn.session)
        seconds = time.perf_counter() - started
        stats1, verifications1 = engine.stats(), engine.speculator.proposed_per_position[:1]
        return RunResult(seconds, done, cpu, stats1.prefix_cache_hit_tokens_total - stats0.prefix_cache_hit_tokens_total,
                         stats1.spec_draft_tokens_total - stats0.spec_draft_tokens_total,
                         stats1.spec_accepted_tokens_total - stats0.spec_accepted_tokens_total,
                         sum(verifications1) - sum(verifications0))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def summarize(r: RunResult) -> dict[str, float]:
    ttft = [(t.first_at - t.added_at) * 1e3 for t in r.turns if t.first_at is not None]
    itl = [(t.last_at - t.first_at) / (len(t.output) - 1) * 1e3 for t in r.turns if len(t.output) > 1]
    reusable = sum(t.reusable for t in r.turns)
    return {
        "tok/s": r.output_tokens / r.seconds,
        "ttft p50": percentile(ttft, 0.5), "ttft p99": percentile(ttft, 0.99),
        "itl p50": percentile(itl, 0.5), "itl p99": percentile(itl, 0.99),
        "hit rate": r.hit_tokens / reusable if reusable else float("nan"),
        "accepted/verify": r.accepted_tokens / r.verifications if r.verifications else float("nan"),
        "acceptance": r.accepted_tokens / r.draft_tokens if r.draft_tokens else float("nan"),
        "cpu s/Mtok": r.cpu_seconds / max(r.output_tokens, 1) * 1e6,
        "turns": len(r.turns), "tokens": r.output_tokens,
    }


def build_engine(name: str, args: argparse.Namespace) -> LLMEngine:
    knobs = dict(CONFIGS[name])
    if name != "plain":
        knobs["num_speculative_tokens"] = args.eagle_k if name == "eagle" else args.k
    return LLMEngine(EngineConfig(model=str(args.model), dtype=args.dtype, num_threads=args.threads,
                                  max_num_seqs=max(args.sessions), kv_cache_memory_bytes=args.kv_cache_mib * 2**20,
                                  **knobs))


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_TARGET)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                    help="the first is the baseline of every ratio")
    ap.add_argument("--workloads", nargs="+", default=["code-edit", "chat"], choices=list(WORKLOADS))
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-turns", type=int, default=None, help="cap on each session's turns")
    ap.add_argument("--k", type=int, default=8, help="max draft tokens of n-gram and suffix (k adapts below it)")
    ap.add_argument("--eagle-k", type=int, default=4, help="max draft tokens of the EAGLE head")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is steadiest on a shared CPU)")
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the report here (markdown)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    cases = [(w, n) for w in args.workloads for n in args.sessions]
    results: dict[tuple[str, int], dict[str, dict]] = {case: {} for case in cases}
    for name in tqdm(args.configs, desc="configurations"):  # one engine in memory at a time
        runner = SessionRunner(build_engine(name, args), tokenizer)
        for w in args.workloads:  # warm-up: a short turn of each workload
            runner.run(w, 2, seed=10_000 + args.seed, max_turns=1, max_tokens=24)
        for case_index, (workload, n) in enumerate(cases):  # the same sessions (seed) for every configuration
            run = runner.run(workload, n, seed=args.seed * 100 + case_index, max_turns=args.max_turns)
            results[(workload, n)][name] = summarize(run)
            tqdm.write(f"{name}, {workload}, {n} session(s): {results[(workload, n)][name]['tok/s']:.1f} tok/s")
        del runner
        gc.collect()
        report = render(results, args)  # after each configuration, so that a long run leaves what it measured
        if args.out is not None:
            args.out.write_text(report)
    print(report)


def render(results: dict[tuple[str, int], dict[str, dict]], args) -> str:
    rows = []
    for (workload, n), by_config in results.items():
        base = by_config.get(args.configs[0], {}).get("tok/s", float("nan"))
        rows += [(workload, n, name, r, r["tok/s"] / base) for name, r in by_config.items()]
    fmt = lambda x, f: "-" if x != x else format(x, f)  # noqa: E731
    lines = [
        "# Agentic sessions: plain decoding against n-gram, suffix and EAGLE speculation", "",
        "    " + " ".join(["python -m perf.bench_agentic", *sys.argv[1:]]), "",
        f"{cpu_model()}, {args.threads} torch thread(s), {args.model.name} in {args.dtype}, greedy; "
        f"n-gram and suffix k <= {args.k}, EAGLE k <= {args.eagle_k}, adaptive; one run, one configuration "
        f"after another on one engine each (ratios against {args.configs[0]} in the same run).", "",
        "| workload | sessions | config | tok/s | vs " + args.configs[0] + " | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
        "prefix hits / reusable | accepted / verification | acceptance | engine CPU s / M tokens | turns | tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, n, name, r, ratio in rows:
        lines.append(
            f"| {workload} | {n} | {name} | {r['tok/s']:.1f} | {fmt(ratio, '.2f')}x | {r['ttft p50']:.0f} / {r['ttft p99']:.0f} | "
            f"{r['itl p50']:.1f} / {r['itl p99']:.1f} | {fmt(r['hit rate'], '.0%')} | {fmt(r['accepted/verify'], '.2f')} | "
            f"{fmt(r['acceptance'], '.0%')} | {r['cpu s/Mtok']:.0f} | {r['turns']} | {r['tokens']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
