"""What the verdict promises, tried as a statistician would: simulated experiments
(perf/ab_simulation.py) replayed with a look after every request.

Seeds are fixed, so each test gives the same answer every run. The tolerances are binomial bounds:
a count of A/A experiments called different is allowed up to the 1 - 1e-4 quantile of
Binomial(runs, alpha), so an implementation whose true rate is at most alpha would fail here less
than once in 10,000 seeds. perf/ab_error_rates.py runs 1,000 of each (docs/experiments.md).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binom

from perf.ab_simulation import ARMS, Scenario, a_a_scenarios, run, simulate_rollout
from serving.experiments.request_log import RequestColumns
from serving.experiments.metrics import ALPHA
from serving.experiments.verdict import Verdict
from serving.experiments.rollout import RolloutPlan

RUNS = 200
SCALE = 0.1  # a tenth of the logs perf/ab_error_rates.py uses
ROLLOUTS = 30


def allowed(runs: int, rate: float = ALPHA) -> int:
    """The most events out of `runs` that a true rate of `rate` gives with probability 1 - 1e-4."""
    return int(binom.isf(1e-4, runs, rate))


@pytest.mark.parametrize("scenario", a_a_scenarios(SCALE), ids=lambda s: s.name)
def test_identical_arms_are_called_different_at_most_at_alpha_under_continuous_looks(scenario):
    called = [seed for seed in range(RUNS) if run(scenario, 10_000 + seed).decision(ARMS[1])[0] != "no difference"]
    assert len(called) <= allowed(RUNS), (len(called), called)


@pytest.mark.parametrize("effect,within", [
    (dict(slower=1.25), 1_000), (dict(treatment_error_rate=0.05), 4_000), (dict(treatment_tail_factor=15.0), 20_000)])
def test_a_worse_arm_is_found_worse(effect, within):
    """25 % slower, 5 % more errors, or a tail-only regression (p99 about 3x, median unchanged):
    called worse within the given requests per arm in at least 18 of 20 runs."""
    scenario = Scenario("worse", ((2 * within, (50, 50)),), users=2000, zipf=0.8, **effect)
    found = sum(run(scenario, 20_000 + seed, until_decided=True).decision(ARMS[1])[0] == "worse" for seed in range(20))
    assert found >= 18, found


def test_rollouts_of_identical_arms_are_rarely_rolled_back_and_harmful_ones_never_pass_ten_percent():
    """Rollouts 1 -> 10 -> 50 -> 100 %: identical arms rolled back at most at 5 % (binomial bound);
    an arm with 20 % errors or twice the TTFT rolled back at 1 % or 10 %, every time."""
    traffic = Scenario("rollout", (), users=20000, zipf=0.6)
    plan = RolloutPlan(ARMS[1], (1.0, 10.0, 50.0, 100.0), min_requests=100)
    same = [simulate_rollout(traffic, plan, 30_000 + seed, 15_000) for seed in range(ROLLOUTS)]
    rolled_back = [o for o in same if o.outcome == "rolled back"]
    assert len(rolled_back) <= allowed(ROLLOUTS), rolled_back
    assert all(o.percent >= 10.0 for o in same if o.outcome is None)  # the others moved on
    for harm in (dict(treatment_error_rate=0.2), dict(slower=2.0)):
        for seed in range(ROLLOUTS // 2):
            outcome = simulate_rollout(traffic.treated(**harm), plan, 40_000 + seed, 30_000)
            assert outcome.outcome == "rolled back" and outcome.percent <= 10.0, (harm, seed, outcome)


RECORDED = Path(__file__).parent / "data" / "ab_recorded_samples.json"


def test_a_a_on_recorded_latencies_stays_within_the_nominal_rate():
    """60 A/A experiments on latencies the gateway recorded in a real experiment
    (perf/ab_experiment.py, its control arm's requests): each draws 1,200 requests from them for
    two arms, each request a user of its own, and looks after every one. A fixed-sample z-test read
    every 20 requests would cry wolf far more often on the same data."""
    recorded = json.loads(RECORDED.read_text())
    requests = np.column_stack([recorded[m]["off"] for m in ("ttft", "itl", "e2e")])
    assert len(requests) >= 100 and bool((requests > 0).all())
    rng = np.random.default_rng(3)
    called = naive = 0
    for _ in range(60):
        drawn = requests[rng.integers(0, len(requests), 1200)]
        arms = np.array(ARMS, dtype=object)[rng.integers(0, 2, 1200)]
        verdict = Verdict(list(ARMS))
        verdict.add(RequestColumns(arms, np.full(1200, None, dtype=object), np.full(1200, "ok", dtype=object),
                                   np.zeros(1200, np.int64), drawn[:, 0], drawn[:, 1], drawn[:, 2]))
        called += verdict.decision(ARMS[1])[0] != "no difference"
        log_ttft, treated = np.log(drawn[:, 0]), arms == ARMS[1]
        naive += any(_z_test_p(log_ttft[:n][~treated[:n]], log_ttft[:n][treated[:n]]) < 0.05 for n in range(40, 1201, 20))
    assert called <= allowed(60), called
    assert naive >= 10, naive  # the data can tell: looking often at a fixed-sample test is wrong often


def _z_test_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided p-value of a fixed-sample z-test of equal means (valid for one look only)."""
    z = (a.mean() - b.mean()) / math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    return math.erfc(abs(z) / math.sqrt(2))
