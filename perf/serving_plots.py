"""Plots of serving benchmark points (perf/bench_serving.py), one line per server variant.

    latency_vs_rate: TTFT, TPOT and end-to-end latency (p50 solid, p99 dashed) and goodput against
                     the request rate, with the SLO limits drawn in
    throughput_vs_concurrency: output tokens/s and requests/s against the concurrency
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

LATENCIES = (("ttft_s", "TTFT", "ttft"), ("tpot_s", "TPOT", "tpot"), ("e2e_latency_s", "end-to-end latency", None))


def _log2_x(ax) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _rate_points(points: list[dict]) -> list[dict]:
    return sorted((p for p in points if p.get("request_rate") is not None), key=lambda p: p["request_rate"])


def _concurrency_points(points: list[dict]) -> list[dict]:
    return sorted((p for p in points if p.get("concurrency") is not None), key=lambda p: p["concurrency"])


def plot_latency_vs_rate(results: dict[str, list[dict]], path: Path) -> Path | None:
    series = {name: _rate_points(points) for name, points in results.items()}
    series = {name: pts for name, pts in series.items() if pts}
    if not series:
        return None
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    colors = dict(zip(series, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, (key, title, slo_key) in zip(axes, LATENCIES):
        for name, pts in series.items():
            rates = [p["request_rate"] for p in pts]
            for pct, style in (("p50", "-"), ("p99", "--")):
                values = [p[key][pct] for p in pts]
                if any(v is not None for v in values):
                    ax.plot(rates, [float("nan") if v is None else v for v in values], style,
                            marker="o", ms=3, color=colors[name], label=f"{name} {pct}")
        if slo_key:
            slo = next(iter(series.values()))[0]["slo"][slo_key]
            ax.axhline(slo, color="grey", lw=0.8, ls=":", label="SLO")
        ax.set(title=title, xlabel="request rate (req/s)", ylabel="seconds", yscale="log")
        _log2_x(ax)
        ax.grid(alpha=0.3)
    ax = axes[3]
    for name, pts in series.items():
        rates = [p["request_rate"] for p in pts]
        ax.plot(rates, [p["goodput"] for p in pts], "-", marker="o", ms=3, color=colors[name], label=f"{name} goodput")
        ax.plot(rates, [p["request_throughput"] for p in pts], ":", color=colors[name], label=f"{name} throughput")
    ax.set(title="goodput under the SLO", xlabel="request rate (req/s)", ylabel="req/s")
    _log2_x(ax)
    ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_throughput_vs_concurrency(results: dict[str, list[dict]], path: Path) -> Path | None:
    series = {name: _concurrency_points(points) for name, points in results.items()}
    series = {name: pts for name, pts in series.items() if pts}
    if not series:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, pts in series.items():
        conc = [p["concurrency"] for p in pts]
        axes[0].plot(conc, [p["output_throughput"] for p in pts], marker="o", label=name)
        axes[1].plot(conc, [p["request_throughput"] for p in pts], marker="o", label=name)
    axes[0].set(title="output tokens/s", xlabel="concurrency", ylabel="tokens/s")
    axes[1].set(title="requests/s", xlabel="concurrency", ylabel="req/s")
    for ax in axes:
        _log2_x(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_all(results: dict[str, list[dict]], stem: Path) -> list[Path]:
    """Both plots, as `<stem>_latency_vs_rate.png` and `<stem>_throughput_vs_concurrency.png`."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    made = [
        plot_latency_vs_rate(results, stem.with_name(f"{stem.name}_latency_vs_rate.png")),
        plot_throughput_vs_concurrency(results, stem.with_name(f"{stem.name}_throughput_vs_concurrency.png")),
    ]
    return [p for p in made if p is not None]
