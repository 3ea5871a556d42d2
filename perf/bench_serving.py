"""Serving benchmark: streaming requests to a running server, as its users see them.

Prompts come from a dataset (code cut from held-out standard-library files, or random tokens),
are sent over the tritonclient gRPC stream to a model (the `llm` ensemble by default) either with
Poisson arrivals at a request rate or at a fixed concurrency (perf/serving_load.py). Reported per
load point (see perf/serving_metrics.py for the definitions): request and output-token
throughput, TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99), and goodput under an SLO
(default TTFT < 1 s and TPOT < 100 ms). Results go to a JSON file, plots (latency percentiles vs
request rate, throughput vs concurrency) to PNGs beside it.

    python -m perf.bench_serving --url localhost:8001 --request-rates 1 2 4 --num-prompts 64
    python -m perf.bench_serving --concurrencies 1 8 32 --dataset random --output-tokens 64

perf/sweep_serving.py runs the same load against several servers it starts itself.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from perf import RESULTS_DIR
from perf.serving_load import add_load_arguments, load_prompts, requests_for, run_benchmark
from perf.serving_plots import plot_all


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001", help="gRPC address")
    p.add_argument("--model", default="llm")
    add_load_arguments(p)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_serving.json")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    args = p.parse_args()
    if not args.request_rates and not args.concurrencies:
        args.request_rates = [1.0]

    n = max(requests_for(args, r, c) for r, c in
            [(r, None) for r in args.request_rates] + [(None, c) for c in args.concurrencies])
    prompts = load_prompts(args.tokenizer, args.dataset, n, *args.input_tokens, args.seed, args.prompt_cache)
    points = run_benchmark(args, args.url, args.model, prompts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"config": config, "points": points}, indent=2))
    print(f"results: {args.out}")
    if args.plots:
        for path in plot_all({args.model: points}, args.out.with_suffix("")):
            print(f"plot: {path}")


if __name__ == "__main__":
    main()
