"""The verdict's error rates and power, measured on simulated logs with a look after every request
(perf/ab_simulation.py), and guarded rollouts over simulated traffic.

    python -m perf.ab_error_rates --runs 1000 --workers 2 --out perf/results/ab_error_rates.md

Three tables, each rate with its 95 % Clopper-Pearson interval:
  - identical arms (A/A): how often any metric of the treatment is ever called different;
  - a 10 % and a 25 % slower arm, a tail-only regression, an arm with 3 % more errors: how often
    it is called worse, and the requests per arm it took (median and 90th percentile);
  - rollouts (1 -> 10 -> 50 -> 100 %): how often identical arms are rolled back, and at which share an
    arm with 20 % errors or twice the TTFT is rolled back.
"""
from __future__ import annotations

import argparse
import time
from multiprocessing import Pool

import numpy as np

from perf import RESULTS_DIR
from perf.ab_simulation import (
    ARMS,
    Scenario,
    a_a_scenarios,
    rate_interval,
    requests_per_arm,
    run,
    simulate,
    simulate_rollout,
)
from serving.experiments.rollout import RolloutPlan

POWER_BASE = Scenario("2,000 users, Zipf, 50:50", ((20000, (50, 50)),), users=2000, zipf=0.8)
POWER = [("10 % slower", POWER_BASE.treated(slower=1.1)), ("25 % slower", POWER_BASE.treated(slower=1.25)),
         ("tail only: 3 % of requests 15x slow, not 5x", POWER_BASE.treated(treatment_tail_factor=15.0)),
         ("3 % server errors more", POWER_BASE.treated(treatment_error_rate=0.03))]
ROLLOUT_TRAFFIC = Scenario("20,000 users, Zipf", (), users=20000, zipf=0.6)
ROLLOUT_PLAN = RolloutPlan(ARMS[1], (1.0, 10.0, 50.0, 100.0), min_requests=100)
ROLLOUTS = [("identical arms", ROLLOUT_TRAFFIC), ("20 % errors", ROLLOUT_TRAFFIC.treated(treatment_error_rate=0.2)),
            ("2x TTFT", ROLLOUT_TRAFFIC.treated(slower=2.0))]
ROLLOUT_REQUESTS = 20000  # a rollout still holding after these is counted as not rolled back
TABLES = ("a_a", "power", "rollouts")


def _a_a(job: tuple[int, int]) -> tuple[int, bool]:
    index, seed = job
    return index, run(a_a_scenarios()[index], seed).decision(ARMS[1])[0] != "no difference"


def _power(job: tuple[int, int]) -> tuple[int, int | None]:
    index, seed = job
    scenario = POWER[index][1]
    decision, at = run(scenario, seed, until_decided=True).decision(ARMS[1])
    return index, requests_per_arm(simulate(scenario, seed), at if decision == "worse" else None)


def _rollout(job: tuple[int, int]) -> tuple[int, str | None, float]:
    index, seed = job
    outcome = simulate_rollout(ROLLOUTS[index][1], ROLLOUT_PLAN, seed, ROLLOUT_REQUESTS)
    return index, outcome.outcome, outcome.percent


def _rate(k: int, n: int) -> str:
    low, high = rate_interval(k, n)
    return f"{k}/{n} = {100 * k / n:.1f} % ({100 * low:.1f}-{100 * high:.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1000, help="simulated experiments per A/A scenario and per effect")
    p.add_argument("--rollouts", type=int, default=None, help="simulated rollouts per case (default: --runs)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS_DIR / "ab_error_rates.md"))
    p.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES), help="which tables (default: all)")
    args = p.parse_args()
    rollouts = args.rollouts or args.runs
    started = time.perf_counter()
    a_a, power, ramps = [], [], []
    with Pool(args.workers) as pool:
        if "a_a" in args.tables:
            a_a = pool.map(_a_a, [(i, s) for i in range(len(a_a_scenarios())) for s in range(args.runs)], chunksize=4)
        if "power" in args.tables:
            power = pool.map(_power, [(i, s) for i in range(len(POWER)) for s in range(args.runs)], chunksize=4)
        if "rollouts" in args.tables:
            ramps = pool.map(_rollout, [(i, s) for i in range(len(ROLLOUTS)) for s in range(rollouts)], chunksize=2)
    lines = [f"`python -m perf.ab_error_rates --runs {args.runs} --rollouts {rollouts} --tables {' '.join(args.tables)}` "
             f"({time.perf_counter() - started:.0f} s); alpha 0.05, default metrics and guardrails, "
             "a look after every request", ""]
    if a_a:
        lines += ["| identical arms (A/A) | requests | called different (95 % CI) |", "|---|---:|---|"]
    for i, scenario in enumerate(a_a_scenarios() if a_a else []):
        k = sum(bad for j, bad in a_a if j == i)
        lines.append(f"| {scenario.name} | {scenario.requests:,} | {_rate(k, args.runs)} |")
    if power:
        lines += ["", f"| effect ({POWER_BASE.name}, up to {POWER_BASE.requests:,} requests) | called worse (95 % CI) "
                      "| treatment requests when called: median, p90 |", "|---|---|---:|"]
    for i, (name, _) in enumerate(POWER if power else []):
        found = [n for j, n in power if j == i and n is not None]
        spread = f"{np.median(found):,.0f}, {np.percentile(found, 90):,.0f}" if found else "-"
        lines.append(f"| {name} | {_rate(len(found), args.runs)} | {spread} |")
    if ramps:
        lines += ["", f"| rollout {' -> '.join(f'{s:g}' for s in ROLLOUT_PLAN.steps)} % ({ROLLOUT_TRAFFIC.name}, "
                      f"{ROLLOUT_PLAN.min_requests} arm requests a step) | rolled back (95 % CI) | at 1 % | at 10 % "
                      "| later |", "|---|---|---:|---:|---:|"]
    for i, (name, _) in enumerate(ROLLOUTS if ramps else []):
        back = [percent for j, outcome, percent in ramps if j == i and outcome == "rolled back"]
        lines.append(f"| {name} | {_rate(len(back), rollouts)} | {sum(p == 1.0 for p in back)} | "
                     f"{sum(p == 10.0 for p in back)} | {sum(p > 10.0 for p in back)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as out:
        out.write(text)


if __name__ == "__main__":
    main()
