"""What the hop to the engine core process costs: the engine in this process (EngineLoop) against
the engine in a process of its own (EngineCoreClient, ZeroMQ), side by side in one run.

Per system: time to first token and mean inter-token latency of requests sent one at a time
(greedy, EOS ignored), and tokens/s of N concurrent requests. Both run the same model and
requests; each is warmed up first.

    python -m perf.bench_engine_core                         # the default model
    python -m perf.bench_engine_core --concurrency 32 --max-tokens 64
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.process.engine_core_client import EngineCoreClient
from backend.engine_loop import EngineLoop
from backend.sampling_params import SamplingParams
from perf.prompts import DEFAULT_TARGET


class Timings:
    """Output arrival times per request; `done` once `expected` requests have finished."""

    def __init__(self, expected: int):
        self.times: dict[str, list[float]] = {}
        self.tokens = 0
        self.finished = 0
        self.expected = expected
        self.done = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, output) -> None:
        now = time.perf_counter()
        with self.lock:
            self.times.setdefault(output.request_id, []).extend([now] * len(output.token_ids))
            self.tokens += len(output.token_ids)
            if output.finished:
                self.finished += 1
                if self.finished == self.expected:
                    self.done.set()


def prompt(i: int, length: int) -> list[int]:
    return [(7 * i + 13 * j) % 4000 + 10 for j in range(length)]


def one_at_a_time(loop, n: int, args) -> tuple[float, float]:
    """Median time to first token and median inter-token latency, in ms."""
    ttft, itl = [], []
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        timings = Timings(1)
        sent = time.perf_counter()
        loop.submit(prompt(i, args.prompt_len), params, timings, f"seq-{id(timings)}")
        timings.done.wait(300)
        (times,) = timings.times.values()
        ttft.append(times[0] - sent)
        itl.append((times[-1] - times[0]) / max(len(times) - 1, 1))
    return 1e3 * statistics.median(ttft), 1e3 * statistics.median(itl)


def concurrent(loop, args) -> float:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    timings = Timings(args.concurrency)
    started = time.perf_counter()
    for i in range(args.concurrency):
        loop.submit(prompt(100 + i, args.prompt_len), params, timings, f"con-{i}")
    timings.done.wait(600)
    return timings.tokens / (time.perf_counter() - started)


def measure(name: str, loop, args) -> dict:
    loop.start()
    one_at_a_time(loop, 2, args)  # warm-up
    ttft, itl = one_at_a_time(loop, args.requests, args)
    tokens_per_s = concurrent(loop, args)
    loop.shutdown()
    return {"system": name, "ttft_ms": ttft, "itl_ms": itl, "tok_s": tokens_per_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_TARGET)
    ap.add_argument("--requests", type=int, default=8, help="requests sent one at a time")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of the engine")
    args = ap.parse_args()
    config = EngineConfig(model=str(args.model), num_threads=args.threads)
    rows = [measure("engine in this process (EngineLoop)", EngineLoop(LLMEngine(config)), args),
            measure("engine core process (EngineCoreClient)", EngineCoreClient(config), args)]
    base = rows[0]
    print(f"model {args.model.name}, prompts {args.prompt_len} tokens, {args.max_tokens} new tokens, "
          f"{args.requests} sequential requests, {args.concurrency} concurrent, torch threads {args.threads}")
    print("| system | TTFT ms (median) | inter-token ms (median) | tok/s, concurrent | vs in-process |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['system']} | {r['ttft_ms']:.2f} | {r['itl_ms']:.2f} | {r['tok_s']:.1f} | "
              f"{r['tok_s'] / base['tok_s']:.2f}x |")


if __name__ == "__main__":
    main()
