"""`specserve-ab report`: an A/B experiment's verdict from the OpenAI gateway, as a table, and a
plot of the arms' latency distributions.

    specserve-ab report --url http://localhost:9000                 # the table
    specserve-ab report --url http://localhost:9000 --plot ab.png   # and the plot (matplotlib)
    specserve-ab report --json                                      # GET /v1/experiment as is
The API key, if the gateway has one, comes from $SPECSERVE_API_KEY.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request

LATENCIES = ("ttft", "itl", "e2e")


def fetch(url: str, path: str) -> dict:
    headers = {"Authorization": f"Bearer {os.environ['SPECSERVE_API_KEY']}"} if os.environ.get("SPECSERVE_API_KEY") else {}
    with urllib.request.urlopen(urllib.request.Request(f"{url}{path}", headers=headers), timeout=60) as response:
        return json.loads(response.read())


def table(report: dict) -> str:
    lines = [f"experiment {report['experiment']}: weights {report['weights']}, control {report['control']}"]
    for arm, reasons in report["requests"].items():
        lines.append(f"  {arm}: {sum(reasons.values())} requests {reasons}")
    lines.append(f"{'arm':>12} | {'metric':>12} | {'p50 (95% CI)':>24} | {'p99':>9} | {'ratio (95% CI)':>22} | "
                 f"{'p-value':>7} | verdict")
    for arm, metrics in report["versus_control"].items():
        for metric, v in metrics.items():
            if "ratio" not in v:
                lines.append(f"{arm:>12} | {metric:>12} | {v['verdict']} (n = {v['n']})")
                continue
            p50, low, high = v["percentiles"][arm]["50"]
            ratio, r_low, r_high = v["ratio"]
            more = f", ~{v['more_needed']} more per arm" if v["verdict"] == "no difference yet" else ""
            lines.append(f"{arm:>12} | {metric:>12} | {p50:8.4f} ({low:.4f}-{high:.4f}) | "
                         f"{v['percentiles'][arm]['99'][0]:9.4f} | {ratio:6.3f}x ({r_low:.3f}-{r_high:.3f}) | "
                         f"{v['p_value']:7.3f} | {v['verdict']}{more}")
    if "rollout" in report:
        rollout = report["rollout"]
        lines.append(f"rollout of {rollout['arm']}: {rollout['percent']}%"
                     f"{' (ended)' if rollout['finished'] else ''}")
        lines += [f"  {d['action']} -> {d['percent']}%: {d['reason']}" for d in rollout["decisions"]]
    return "\n".join(lines)


def plot(url: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(5 * len(LATENCIES), 3.5))
    for ax, metric in zip(axes, LATENCIES):
        for arm, values in fetch(url, f"/v1/experiment/samples?metric={metric}").items():
            if values:
                ax.ecdf(np.array(values) * 1e3, label=f"{arm} (n = {len(values)})")
        ax.set_xscale("log")
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("share of requests")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specserve-ab", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("report",))
    p.add_argument("--url", default="http://localhost:9000", help="the OpenAI gateway running the experiment")
    p.add_argument("--json", action="store_true", help="print the verdict's JSON")
    p.add_argument("--plot", help="write the arms' latency distributions (ECDFs) to this image")
    args = p.parse_args(argv)
    report = fetch(args.url, "/v1/experiment")
    print(json.dumps(report, indent=1) if args.json else table(report))
    if args.plot:
        plot(args.url, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
