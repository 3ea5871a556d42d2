"""A real A/B experiment through the OpenAI gateway: adaptive speculation (prompt lookup) on or off
on the default model, under a Poisson load of chat users, ending in the verdict and its plot.

One tritonserver serves `llm` (the default configuration: no speculation) and `llm_ngram` (the
same engine with `speculative_method` ngram and adaptive k); the gateway splits users 50/50 by
their OpenAI `user` field. --requests streamed chat completions arrive as a Poisson process of
--rate per second, each from one of --users users, asking one of the held-out chat and code
prompts (scripts/chat_prompts.py), greedy, up to --max-tokens tokens. At the end: the gateway's
verdict (`specserve-ab report`), its JSON, the plot of both arms' latency distributions, their
ECDFs as counts, and the gateway's request log (`specserve-ab replay OUT_requests.jsonl --control off`
reads it back through the same verdict).

    python -m perf.ab_experiment --out perf/results/ab_experiment
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from client.ab_report import fetch, plot, table
from perf import RESULTS_DIR
from perf.serving_load import wait_for
from scripts.chat_prompts import HELDOUT
from serving.launch.launcher import DEFAULT_MODEL_REPOSITORY, free_port, free_ports, start_server
from serving.launch.repository_variants import add_variant, make_repository

EXPERIMENT = {"name": "ngram-speculation", "sticky_key": "user",
              "arms": [{"name": "off", "model": "llm", "weight": 50}, {"name": "ngram", "model": "llm_ngram", "weight": 50}]}
LATENCIES = ("ttft", "itl", "e2e")


async def poisson_load(base_url: str, args) -> dict[str, int]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    rng = random.Random(args.seed)
    outcomes: dict[str, int] = {}

    async def one(i: int) -> None:
        user = f"user-{rng.randrange(args.users)}"
        try:
            stream = await client.chat.completions.create(
                model="specserve", messages=[{"role": "user", "content": rng.choice(HELDOUT)}], stream=True,
                max_tokens=args.max_tokens, temperature=0, user=user)
            async for _ in stream:
                pass
            outcomes["ok"] = outcomes.get("ok", 0) + 1
        except Exception as e:  # counted: the gateway records the arm's errors too
            outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1

    tasks = []
    for i in range(args.requests):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.gather(*tasks)
    await client.close()
    return outcomes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson arrivals)")
    p.add_argument("--users", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1, help="each engine's torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "ab_experiment",
                   help="writes OUT.md (the verdict), OUT.json, OUT.png, OUT_ecdf.json and OUT_requests.jsonl")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="specserve-ab-") as tmp:
        repository = make_repository(DEFAULT_MODEL_REPOSITORY, Path(tmp) / "repository",
                                     {"llm_engine": {"num_threads": str(args.threads)}})
        add_variant(repository, "ngram", {"speculative_method": "ngram", "adaptive_speculation": "true"})
        experiment_file = Path(tmp) / "experiment.json"
        experiment_file.write_text(json.dumps(EXPERIMENT))
        http_port, grpc_port, metrics_port = free_ports(3)
        handle = start_server(repository, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                              log_file=Path(tmp) / "tritonserver.log", log_level="warning", ready_timeout=900)
        port = free_port()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        log = Path(f"{args.out}_requests.jsonl")
        log.unlink(missing_ok=True)
        gateway = subprocess.Popen(
            [sys.executable, "-m", "serving.gateway.server", "--triton", handle.grpc_url, "--port", str(port),
             "--experiment", str(experiment_file), "--experiment-log", str(log)],
            env=os.environ | {"SPECSERVE_ADMIN_KEY": secrets.token_urlsafe(16)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(f"{url}/health", 60)
            started = time.perf_counter()
            outcomes = asyncio.run(poisson_load(f"{url}/v1", args))
            wall = time.perf_counter() - started
            report = fetch(url, "/v1/experiment")
            ecdf = {metric: fetch(url, f"/v1/experiment/ecdf?metric={metric}") for metric in LATENCIES}
            plot(url, str(args.out.with_suffix(".png")))
        finally:
            gateway.terminate()
            gateway.wait(30)
            handle.stop()
    text = table(report)
    header = (f"{args.requests} streamed chat requests, Poisson arrivals at {args.rate}/s from {args.users} users, "
              f"greedy, up to {args.max_tokens} tokens, {args.threads} engine thread(s) per arm; {wall:.0f} s; "
              f"client outcomes {outcomes}")
    print(header + "\n\n" + text)
    args.out.with_suffix(".md").write_text(f"`python -m perf.ab_experiment` ({header})\n\n```\n{text}\n```\n")
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    Path(f"{args.out}_ecdf.json").write_text(json.dumps(ecdf))


if __name__ == "__main__":
    main()
