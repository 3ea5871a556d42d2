"""`specserve-ab`: an A/B experiment's verdict, from the OpenAI gateway or replayed from its log.

    specserve-ab report --url http://localhost:9000                 # the gateway's verdict, as a table
    specserve-ab report --url http://localhost:9000 --plot ab.png   # and the arms' latency ECDFs
    specserve-ab report --json                                      # GET /v1/experiment as is
    specserve-ab replay LOG --control NAME --json                   # the verdict over a request log
    specserve-ab replay LOG1 LOG2 --control NAME                    # over several gateway replicas' logs

`replay` reads a request log (serving/experiments/request_log.py; rotated files too, oldest first) in arrival order
through the very verdict the gateway runs (serving/experiments/verdict.py), looking after every request, and
prints the same JSON: under "arms", for each arm other than the control, its "decision" ("better",
"worse" or "no difference") and per metric the estimate, its confidence sequence, the always-valid
p-value and the request index at which it was decided. `--experiment FILE` takes the metrics (success
metrics, guardrails and their margins, alpha) from an experiment file. The API key, if the gateway
has one, comes from $SPECSERVE_API_KEY.
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


def replay(logs: str | list[str], control: str, experiment: str | None = None) -> dict:
    """The verdict over a request log, or several replicas' logs merged in time order (each
    replica's periods strata of their own), looking after every request."""
    from serving.experiments.request_log import RequestColumns, read_logs
    from serving.experiments.metrics import VerdictConfig
    from serving.experiments.verdict import Verdict
    from serving.experiments.rollout import load_experiment

    config = load_experiment(experiment)[1] if experiment else VerdictConfig()
    logs = [logs] if isinstance(logs, str) else logs
    arms = {control: None}
    for records in read_logs(logs):
        arms |= dict.fromkeys(r["arm"] for r in records)
    if len(arms) < 2:
        raise SystemExit(f"{', '.join(logs)}: no arm other than {control!r} in the log")
    verdict = Verdict(list(arms), config)
    for records in read_logs(logs):
        verdict.add(RequestColumns.from_records(records))
    return verdict.report()


def _number(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def table(report: dict) -> str:
    head = f"experiment {report['experiment']}: weights {report['weights']}, " if "experiment" in report else ""
    lines = [f"{head}control {report['control']}, {report['requests']} requests, alpha {report['alpha']} "
             f"({report['level_per_test']:.4g} per test)"]
    for arm, statuses in report["statuses"].items():
        q = report["quantiles"][arm]
        lines.append(f"  {arm}: {report['users'][arm]} users, {statuses}; TTFT p50/p99 {_number(q['ttft']['50'])}/"
                     f"{_number(q['ttft']['99'])} s, ITL p50/p99 {_number(q['itl']['50'])}/{_number(q['itl']['99'])} s")
    lines.append(f"{'arm':>12} | {'metric':>9} | {'role':>9} | {'estimate (confidence sequence)':>34} | "
                 f"{'p-value':>7} | {'decided at':>10} | non-inferior (margin)")
    for arm, result in report["arms"].items():
        for metric, v in result["metrics"].items():
            interval = "" if v["interval"] is None else f"({v['interval'][0]:.4g} to {v['interval'][1]:.4g})"
            estimate = f"{_number(v['estimate'])} {v['scale']} {interval}"
            decided = "-" if v["decided_at"] is None else f"{v['direction']} @{v['decided_at']}"
            guard = "" if "margin" not in v else (f"@{v['non_inferior_at']}" if v["non_inferior_at"] is not None
                                                  else "not yet") + f" ({v['margin']:g})"
            lines.append(f"{arm:>12} | {metric:>9} | {v['role']:>9} | {estimate:>34} | {v['p_value']:7.3f} | "
                         f"{decided:>10} | {guard}")
        at = "" if result["decided_at"] is None else f" (after request {result['decided_at']})"
        lines.append(f"{arm:>12}: {result['decision']}{at}")
    if "rollout" in report:
        rollout = report["rollout"]
        lines.append(f"rollout of {rollout['arm']}: {rollout['percent']}%"
                     f"{' (' + rollout['outcome'] + ')' if rollout['finished'] else ''}")
        lines += [f"  {d['action']} -> {d['percent']}%: {d['reason']}" for d in rollout["decisions"]]
    return "\n".join(lines)


def plot(url: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(5 * len(LATENCIES), 3.5))
    for ax, metric in zip(axes, LATENCIES):
        ecdf = fetch(url, f"/v1/experiment/ecdf?metric={metric}")
        edges = np.array(ecdf["edges"]) * 1e3
        for arm, counts in ecdf["counts"].items():
            counts = np.array(counts)
            if counts.sum():  # counts[i]: values in (edges[i - 1], edges[i]]
                ax.step(edges, np.cumsum(counts)[:-1] / counts.sum(), where="post", label=f"{arm} (n = {counts.sum()})")
        ax.set_xscale("log")
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("share of requests")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specserve-ab", description=__doc__.splitlines()[0])
    commands = p.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="the verdict of a running gateway")
    report.add_argument("--url", default="http://localhost:9000", help="the OpenAI gateway running the experiment")
    report.add_argument("--json", action="store_true", help="print the verdict's JSON")
    report.add_argument("--plot", help="write the arms' latency distributions (ECDFs) to this image")
    log = commands.add_parser("replay", help="the verdict over a request log")
    log.add_argument("log", nargs="+", help="the request log (JSON lines; LOG.1, LOG.2, ... are read first); "
                                            "several: each gateway replica's, merged in time order")
    log.add_argument("--control", required=True, help="the control arm's name")
    log.add_argument("--experiment", help="an experiment file whose \"metrics\" to use")
    log.add_argument("--json", action="store_true", help="print the verdict's JSON")
    args = p.parse_args(argv)
    result = fetch(args.url, "/v1/experiment") if args.command == "report" else \
        replay(args.log, args.control, args.experiment)
    print(json.dumps(result, indent=1) if args.json else table(result))
    if getattr(args, "plot", None):
        plot(args.url, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
