"""Server variants side by side under the same load: per variant, the sustainable request rate
under the SLO, the p99 TTFT at the baseline's saturation rate, the peak output tokens/s, each
also as a ratio to the baseline's (perf/sweep_serving.py), and every load point as a table.
"""
from __future__ import annotations

from perf.serving_metrics import saturation_rate, sustainable_rate

BASELINE = "hf-baseline"  # the variant the others are compared to: perf/baseline_repository


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
