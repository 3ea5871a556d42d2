"""One load, several servers: the engine without and with speculative decoding, and a baseline.

Each variant is served by its own tritonserver (serving.launch.launcher, free ports) from a model
repository generated for it in a temporary directory (serving/launch/repository_variants.py): the
configs are copied with engine parameters overridden, the version directories are symbolic links
to the originals. Then perf/serving_load.py's load points run against it: every request rate
(Poisson arrivals), then every concurrency, with the same prompts for every variant.

    engine       the `llm` ensemble, speculative_method none
    engine-process  the same, the engine core in a process of its own (engine_process true)
    engine+spec  the `llm` ensemble as `make serve` serves it: the default model's EAGLE head,
                 adaptive k (at most 4)
    hf-baseline  perf/baseline_repository: HF `generate` per dynamic batch, one response per request

Printed at the end, and written with every point to JSON (plots beside it): per variant, the
sustainable request rate under the SLO (the highest swept rate up to which at least 90% of the
requests met it), the p99 TTFT at the baseline's saturation rate (the lowest swept rate at which
the baseline completed under 90% of the offered requests per second), the peak output tokens/s,
and each as a ratio to the baseline.

    python -m perf.sweep_serving                                   # defaults: about 4 minutes per variant
    python -m perf.sweep_serving --report perf/results/sweep_serving.json   # tables and plots again
    python -m perf.sweep_serving --request-rates 1 2 4 --concurrencies 1 16 --variants engine hf-baseline
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from perf import BASELINE_REPOSITORY, REPO_ROOT, RESULTS_DIR
from perf.serving_comparison import BASELINE, compare, markdown_table, points_table
from perf.serving_load import add_load_arguments, load_prompts, requests_for, run_benchmark
from perf.serving_plots import plot_all
from serving.launch.launcher import DEFAULT_MODEL_REPOSITORY, free_ports, start_server
from serving.launch.repository_variants import make_repository

VARIANTS = {  # name -> (source repository, model to benchmark, {model: {parameter: value}})
    "engine": (DEFAULT_MODEL_REPOSITORY, "llm", {"llm_engine": {"speculative_method": "none"}}),
    "engine-process": (DEFAULT_MODEL_REPOSITORY, "llm", {"llm_engine": {
        "speculative_method": "none", "engine_process": "true"}}),
    "engine+spec": (DEFAULT_MODEL_REPOSITORY, "llm", {}),  # the config's own speculation
    BASELINE: (BASELINE_REPOSITORY, "hf_generate", {}),
}
THREADS_PARAMETER = {"llm_engine": "num_threads", "hf_generate": "num_threads"}  # model -> key


def serve_and_measure(name: str, args, prompts: list[str], workdir: Path) -> tuple[list[dict], dict]:
    """The variant's load points, and the engine's counters at the end."""
    source, model, overrides = VARIANTS[name]
    overrides = {m: dict(v) for m, v in overrides.items()}
    if args.num_threads is not None:
        for m, key in THREADS_PARAMETER.items():
            overrides.setdefault(m, {})[key] = str(args.num_threads)
    repository = make_repository(source, workdir / name.replace("+", "_"), overrides)
    log = args.out.parent / f"{args.out.stem}_{name.replace('+', '_')}.tritonserver.log"
    log.unlink(missing_ok=True)
    started = time.perf_counter()
    http_port, grpc_port, metrics_port = free_ports(3)
    handle = start_server(repository, http_port=http_port, grpc_port=grpc_port,
                          metrics_port=metrics_port, log_file=log, log_level="warning", ready_timeout=600)
    try:
        print(f"{name}: ready in {time.perf_counter() - started:.0f} s ({handle.grpc_url}, log {log})", flush=True)
        points = run_benchmark(args, handle.grpc_url, model, prompts, label=f"{name}: ")
        return points, server_metrics(handle.metrics_url)
    finally:
        handle.stop()


def server_metrics(metrics_url: str) -> dict[str, float]:
    """The engine's counters summed over labels (empty for a server without them)."""
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    totals: dict[str, float] = {}
    for m in re.finditer(r"^(specserve_\w+_total)(?:\{[^}]*\})? (\S+)$", text, re.M):
        totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(2))
    drafted = totals.get("specserve_spec_decode_draft_tokens_total")
    if drafted:
        totals["spec_decode_acceptance_rate"] = totals["specserve_spec_decode_accepted_tokens_total"] / drafted
    return totals


def environment() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO_ROOT).stdout.strip()
    return dict(cpu_count=os.cpu_count(), load_average=os.getloadavg(), commit=commit,
                python=sys.version.split()[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    add_load_arguments(p)
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads in every server (default: each config's own)")
    p.add_argument("--min-slo-attainment", type=float, default=0.9)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "sweep_serving.json")
    p.add_argument("--report", type=Path, metavar="JSON",
                   help="only rebuild the tables and plots from a sweep's JSON results")
    p.set_defaults(request_rates=[0.5, 1, 2, 4, 8, 16], concurrencies=[1, 16, 64], duration=15.0, num_prompts=32)
    args = p.parse_args()
    if args.report:
        report(json.loads(args.report.read_text()), args.report)
        return

    loads = [(r, None) for r in args.request_rates] + [(None, c) for c in args.concurrencies]
    prompts = load_prompts(args.tokenizer, args.dataset, max(requests_for(args, r, c) for r, c in loads),
                           *args.input_tokens, args.seed, args.prompt_cache)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env_before = environment()
    started = time.perf_counter()
    results: dict[str, list[dict]] = {}
    counters: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="sweep-serving-") as workdir:
        for name in args.variants:
            results[name], counters[name] = serve_and_measure(name, args, prompts, Path(workdir))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    env = env_before | dict(load_average_after=os.getloadavg(), wall_s=time.perf_counter() - started)
    sweep = dict(config=config, environment=env, server_metrics=counters, results=results)
    sweep["comparison"] = report(sweep, args.out)
    args.out.write_text(json.dumps(sweep, indent=2))
    print(f"results: {args.out}\nwall time {env['wall_s'] / 60:.1f} min, load average "
          f"{env['load_average_after'][0]:.1f} on {env['cpu_count']} CPUs")


def report(sweep: dict, out: Path) -> dict:
    """Prints the comparison, writes it with every point as markdown (`out` with .md) and the
    plots beside `out`; returns the comparison."""
    config, results = sweep["config"], sweep["results"]
    comparison = compare(results, config["min_slo_attainment"])
    slo = f"TTFT < {config['slo_ttft']:g} s, TPOT < {1000 * config['slo_tpot']:g} ms"
    table = markdown_table(comparison, slo)
    out.with_suffix(".md").write_text(f"{table}\n\n{points_table(results)}\n")
    plots = plot_all(results, out.with_suffix(""))
    for name, totals in sweep.get("server_metrics", {}).items():
        if "spec_decode_acceptance_rate" in totals:
            print(f"{name}: draft acceptance rate {totals['spec_decode_acceptance_rate']:.3f} "
                  f"({totals['specserve_spec_decode_draft_tokens_total']:.0f} draft tokens)")
    print(f"\n{table}\n\ntables: {out.with_suffix('.md')}\nplots: {', '.join(map(str, plots))}")
    return comparison


if __name__ == "__main__":
    main()
