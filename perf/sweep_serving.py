"""One load, several servers: the engine without and with speculative decoding, and a baseline.

Each variant is served by its own tritonserver (serving.launcher, free ports) from a model
repository generated for it in a temporary directory: the configs are copied with engine
parameters overridden, the version directories are symbolic links to the originals. Then
perf/bench_serving.py's load points run against it: every request rate (Poisson arrivals), then
every concurrency, with the same prompts for every variant.

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

    python perf/sweep_serving.py                                   # defaults: about 4 minutes per variant
    python perf/sweep_serving.py --report perf/results/sweep_serving.json   # tables and plots again
    python perf/sweep_serving.py --request-rates 1 2 4 --concurrencies 1 16 --variants engine hf-baseline
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.launcher import DEFAULT_MODEL_REPOSITORY, free_port, start_server  # noqa: E402
from perf.bench_serving import RESULTS_DIR, add_load_arguments, load_prompts, requests_for, run_benchmark  # noqa: E402
from perf.serving_metrics import saturation_rate, sustainable_rate  # noqa: E402

BASELINE_REPOSITORY = Path(__file__).resolve().parent / "baseline_repository"
BASELINE = "hf-baseline"
VARIANTS = {  # name -> (source repository, model to benchmark, {model: {parameter: value}})
    "engine": (DEFAULT_MODEL_REPOSITORY, "llm", {"llm_engine": {"speculative_method": "none"}}),
    "engine-process": (DEFAULT_MODEL_REPOSITORY, "llm", {"llm_engine": {
        "speculative_method": "none", "engine_process": "true"}}),
    "engine+spec": (DEFAULT_MODEL_REPOSITORY, "llm", {}),  # the config's own speculation
    BASELINE: (BASELINE_REPOSITORY, "hf_generate", {}),
}
THREADS_PARAMETER = {"llm_engine": "num_threads", "hf_generate": "num_threads"}  # model -> key


def override_parameters(config: str, values: dict[str, str]) -> str:
    """config.pbtxt text with each `parameters` entry in `values` set, appended when missing."""
    for key, value in values.items():
        entry = re.compile(r'(\{\s*key:\s*"' + re.escape(key) + r'"\s*,\s*value:\s*\{\s*string_value:\s*")[^"]*(")')
        if entry.search(config):
            config = entry.sub(lambda m: m.group(1) + value + m.group(2), config)
            continue
        block = re.search(r"^parameters\s*\[(.*?)^\]", config, re.S | re.M)
        line = f'  {{ key: "{key}", value: {{ string_value: "{value}" }} }}'
        if block is None:
            config += f"\nparameters [\n{line}\n]\n"
        else:
            body = block.group(1).rstrip()
            config = config[: block.start(1)] + f"{body},\n{line}\n" + config[block.end(1):]
    return config


def make_repository(source: Path, dest: Path, overrides: dict[str, dict[str, str]]) -> Path:
    """A copy of `source` in `dest`: configs rewritten with `overrides`, version dirs linked."""
    for model_dir in sorted(p for p in source.iterdir() if (p / "config.pbtxt").exists()):
        target = dest / model_dir.name
        target.mkdir(parents=True)
        config = (model_dir / "config.pbtxt").read_text()
        (target / "config.pbtxt").write_text(override_parameters(config, overrides.get(model_dir.name, {})))
        for version in (p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()):
            (target / version.name).symlink_to(version.resolve(), target_is_directory=True)
    return dest


def add_variant(repository: Path, suffix: str, parameters: dict[str, str]) -> None:
    """`llm_<suffix>` in `repository`: `llm` over `llm_engine_<suffix>`, a copy of llm_engine with
    some of its parameters changed (an A/B experiment's arm over another engine configuration)."""
    llm = (repository / "llm" / "config.pbtxt").read_text()
    engine = (repository / "llm_engine" / "config.pbtxt").read_text()
    llm = llm.replace('name: "llm"', f'name: "llm_{suffix}"', 1).replace('"llm_engine"', f'"llm_engine_{suffix}"')
    engine = override_parameters(engine.replace('name: "llm_engine"', f'name: "llm_engine_{suffix}"', 1), parameters)
    for name, config in ((f"llm_{suffix}", llm), (f"llm_engine_{suffix}", engine)):
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(config)
    for source in (repository / "llm_engine" / "1").iterdir():
        if source.suffix == ".py":
            shutil.copy(source, repository / f"llm_engine_{suffix}" / "1" / source.name)
        elif source.is_dir() and not (repository / f"llm_engine_{suffix}" / "1" / source.name).exists():
            (repository / f"llm_engine_{suffix}" / "1" / source.name).symlink_to(source.resolve(), target_is_directory=True)


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
    handle = start_server(repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), log_file=log, log_level="warning", ready_timeout=600)
    try:
        print(f"{name}: ready in {time.perf_counter() - started:.0f} s ({handle.grpc_url}, log {log})", flush=True)
        points = run_benchmark(args, handle.grpc_url, model, prompts, label=f"{name}: ")
        return points, server_metrics(handle.metrics_url)
    finally:
        handle.stop()


def compare(results: dict[str, list[dict]], min_attainment: float) -> dict:
    """The headline numbers per variant, and their ratios to the baseline."""
    rate_points = {name: [p for p in pts if p["request_rate"] is not None] for name, pts in results.items()}
    base_points = rate_points.get(BASELINE, [])
    saturation = saturation_rate(base_points) if base_points else None
    if saturation is None and base_points:
        saturation = max(p["request_rate"] for p in base_points)  # it kept up everywhere: the top rate
    rows = {}
    for name, pts in results.items():
        at_saturation = [p for p in rate_points[name] if p["request_rate"] == saturation]
        rows[name] = dict(
            sustainable_rate=sustainable_rate(rate_points[name], min_attainment),
            p99_ttft_at_baseline_saturation=at_saturation[0]["ttft_s"]["p99"] if at_saturation else None,
            peak_output_throughput=max((p["output_throughput"] for p in pts), default=0.0),
            peak_goodput=max((p["goodput"] for p in rate_points[name]), default=0.0),
        )
    base = rows.get(BASELINE)
    lowest_rate = min((p["request_rate"] for p in base_points), default=None)
    for row in rows.values():
        ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
        row["sustainable_rate_vs_baseline"] = ratio(row["sustainable_rate"], base and base["sustainable_rate"])
        if base and base["sustainable_rate"] == 0 and row["sustainable_rate"] and lowest_rate:
            # the baseline missed at the lowest swept rate: its own sustainable rate is below that
            row["sustainable_rate_vs_baseline_more_than"] = row["sustainable_rate"] / lowest_rate
        row["p99_ttft_lower_than_baseline"] = ratio(base and base["p99_ttft_at_baseline_saturation"],
                                                     row["p99_ttft_at_baseline_saturation"])
        row["output_throughput_vs_baseline"] = ratio(row["peak_output_throughput"], base and base["peak_output_throughput"])
    return dict(baseline_saturation_rate=saturation, min_slo_attainment=min_attainment, variants=rows)


def markdown_table(comparison: dict, slo: str) -> str:
    sat = comparison["baseline_saturation_rate"]
    sat_text = f"{sat:g} req/s" if sat is not None else "n/a"
    lines = [
        f"| server | sustainable rate under SLO ({slo}), req/s | vs baseline | p99 TTFT at {sat_text} "
        "(baseline saturation) | baseline / this | peak output tok/s | vs baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in comparison["variants"].items():
        rate_ratio = _times(r["sustainable_rate_vs_baseline"])
        if r.get("sustainable_rate_vs_baseline_more_than") is not None:
            rate_ratio = f"> {r['sustainable_rate_vs_baseline_more_than']:.1f}x"
        ttft = r["p99_ttft_at_baseline_saturation"]
        lines.append(
            f"| {name} | {r['sustainable_rate']:g} | {rate_ratio} "
            f"| {'-' if ttft is None else f'{1000 * ttft:.0f} ms'} | {_times(r['p99_ttft_lower_than_baseline'])} "
            f"| {r['peak_output_throughput']:.0f} | {_times(r['output_throughput_vs_baseline'])} |"
        )
    return "\n".join(lines)


def points_table(results: dict[str, list[dict]]) -> str:
    """Every load point of every variant, one row each."""
    ms = lambda stats, key: "-" if stats[key] is None else f"{1000 * stats[key]:.0f}"  # noqa: E731
    lines = [
        "| server | load | ok | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| ITL p99 ms | E2E p99 ms | goodput req/s | in SLO |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, points in results.items():
        for p in points:
            load = f"{p['request_rate']:g} req/s" if p["request_rate"] is not None else f"{p['concurrency']} users"
            lines.append(
                f"| {name} | {load} | {p['completed']}/{p['num_requests']} | {p['request_throughput']:.2f} "
                f"| {p['output_throughput']:.0f} | {ms(p['ttft_s'], 'p50')} / {ms(p['ttft_s'], 'p99')} "
                f"| {ms(p['tpot_s'], 'p50')} / {ms(p['tpot_s'], 'p99')} | {ms(p['itl_s'], 'p99')} "
                f"| {ms(p['e2e_latency_s'], 'p99')} | {p['goodput']:.2f} | {100 * p['slo_attainment']:.0f}% |"
            )
    return "\n".join(lines)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


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
                            cwd=Path(__file__).resolve().parent).stdout.strip()
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
    from perf.serving_plots import plot_all

    plots = plot_all(results, out.with_suffix(""))
    for name, totals in sweep.get("server_metrics", {}).items():
        if "spec_decode_acceptance_rate" in totals:
            print(f"{name}: draft acceptance rate {totals['spec_decode_acceptance_rate']:.3f} "
                  f"({totals['specserve_spec_decode_draft_tokens_total']:.0f} draft tokens)")
    print(f"\n{table}\n\ntables: {out.with_suffix('.md')}\nplots: {', '.join(map(str, plots))}")
    return comparison


if __name__ == "__main__":
    main()
