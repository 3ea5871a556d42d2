"""Routing across llm_engine instances: Triton's own hand-out against back-pressure, side by side.

Two servers, one after the other, over the same model repository with llm_engine at
instance_group count 2 (one torch thread each):
  round-robin    max_pending_requests 0: execute() returns at once, so Triton sees both instances
                 idle and hands requests out with no idea of their load
  back-pressure  max_pending_requests N: an instance holds Triton's next request while more than N
                 of its requests wait to start, so the request goes to the instance with room
Both get the same skewed load: Poisson arrivals, a fraction of long requests among short ones
(a seeded draw, identical for both). Reported: TTFT p50/p99 (short and all requests), output
tokens/s, and each instance's share of the requests; then back-pressure / round-robin ratios.

    python -m perf.bench_routing
    python -m perf.bench_routing --rate 4 --num-requests 128 --max-num-seqs 4 --max-pending 1
"""
from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from perf import RESULTS_DIR
from perf.serving_load import StreamingClient, Workload, load_prompts
from serving.launch.launcher import DEFAULT_MODEL_REPOSITORY, free_ports, start_server
from serving.launch.repository_variants import make_repository

TWO_INSTANCES = "instance_group [ { count: 2, kind: KIND_CPU } ]"
FINISHED = "specserve_request_success_total"


def plan(args) -> list[tuple[str, Workload]]:
    """The requests in arrival order: (prompt, workload), long ones drawn with args.long_fraction."""
    prompts = load_prompts(DEFAULT_MODEL_REPOSITORY / "llm_engine" / "1" / "target", "code", args.num_requests,
                           args.prompt_tokens // 2, args.prompt_tokens)
    rng = np.random.default_rng(args.seed)
    long, short = Workload([], args.long_tokens), Workload([], args.short_tokens)
    return [(p, long if rng.random() < args.long_fraction else short) for p in prompts]


async def run_load(url: str, requests: list[tuple[str, Workload]], rate: float, seed: int) -> list:
    client = StreamingClient(url)
    await client.connect()
    rng = np.random.default_rng(seed)
    tasks = []
    for i, (prompt, workload) in enumerate(requests):
        tasks.append(asyncio.create_task(client.send(prompt, workload, i)))
        await asyncio.sleep(rng.exponential(1.0 / rate))
    records = await asyncio.gather(*tasks)
    await client.close()
    return list(records)


def instance_shares(metrics_url: str) -> list[float]:
    """Each instance's share of the finished requests."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counts: dict[str, float] = {}
    for m in re.finditer(rf'^{FINISHED}\{{([^}}]*)\}} (\S+)$', text, re.M):
        instance = re.search(r'model_instance="([^"]*)"', m.group(1))
        if instance:
            counts[instance.group(1)] = counts.get(instance.group(1), 0.0) + float(m.group(2))
    total = sum(counts.values()) or 1.0
    return [counts[k] / total for k in sorted(counts)]


def measure(name: str, max_pending: int, args, requests, workdir: Path) -> dict:
    overrides = {"llm_engine": {"max_pending_requests": str(max_pending), "num_threads": "1",
                                "max_num_seqs": str(args.max_num_seqs)}}
    repository = make_repository(DEFAULT_MODEL_REPOSITORY, workdir / name, overrides)
    config = repository / "llm_engine" / "config.pbtxt"
    config.write_text(config.read_text().replace("instance_group [ { count: 1, kind: KIND_MODEL } ]", TWO_INSTANCES))
    log = RESULTS_DIR / f"bench_routing_{name}.tritonserver.log"
    log.unlink(missing_ok=True)
    http_port, grpc_port, metrics_port = free_ports(3)
    handle = start_server(repository, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                          log_file=log, log_level="warning", ready_timeout=600)
    try:
        started = time.perf_counter()
        records = asyncio.run(run_load(handle.grpc_url, requests, args.rate, args.seed))
        duration = time.perf_counter() - started
        shares = instance_shares(handle.metrics_url)
    finally:
        handle.stop()
    ok = [(r, w) for r, (_, w) in zip(records, requests) if r.ok]
    ttft = np.array([r.chunk_times[0] - r.start for r, _ in ok]) * 1e3
    short_ttft = np.array([r.chunk_times[0] - r.start for r, w in ok if w.output_tokens == args.short_tokens]) * 1e3
    return {
        "name": name, "failed": len(records) - len(ok),
        "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
        "short_ttft_p99": float(np.percentile(short_ttft, 99)),
        "tokens_per_s": sum(r.num_output_tokens for r, _ in ok) / duration,
        "shares": shares,
    }


def table(results: list[dict], args) -> str:
    lines = [
        f"2 instances, {args.num_requests} requests at {args.rate}/s (Poisson), {args.long_fraction:.0%} long "
        f"({args.long_tokens} tokens) among short ({args.short_tokens}), prompts {args.prompt_tokens // 2}-"
        f"{args.prompt_tokens} tokens, max_num_seqs {args.max_num_seqs} per instance",
        "",
        "| routing | TTFT p50 ms | TTFT p99 ms | short TTFT p99 ms | output tok/s | requests per instance | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        shares = " / ".join(f"{s:.0%}" for s in r["shares"])
        lines.append(f"| {r['name']} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['short_ttft_p99']:.0f} | "
                     f"{r['tokens_per_s']:.0f} | {shares} | {r['failed']} |")
    base, bp = results
    lines += ["", f"back-pressure / round-robin: TTFT p99 {bp['ttft_p99'] / base['ttft_p99']:.2f}x, "
              f"short TTFT p99 {bp['short_ttft_p99'] / base['short_ttft_p99']:.2f}x, "
              f"output tok/s {bp['tokens_per_s'] / base['tokens_per_s']:.2f}x"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    p.add_argument("--long-fraction", type=float, default=0.25)
    p.add_argument("--long-tokens", type=int, default=192)
    p.add_argument("--short-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64, help="the longest prompt; the shortest is half")
    p.add_argument("--max-num-seqs", type=int, default=4, help="per instance")
    p.add_argument("--max-pending", type=int, default=1, help="max_pending_requests of the back-pressure run")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    requests = plan(args)
    with tempfile.TemporaryDirectory() as workdir:
        results = [measure("round-robin", 0, args, requests, Path(workdir)),
                   measure("back-pressure", args.max_pending, args, requests, Path(workdir))]
    print(table(results, args))


if __name__ == "__main__":
    main()
