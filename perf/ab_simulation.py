"""Simulated experiment logs, and runs of the verdict over them with a look after every request.

Users have their own latency levels (lognormal across users) and send traffic by a Zipf law; each
request's TTFT and ITL are lognormal around the user's level with a heavy tail (a share of
requests, e.g. preempted or queued, several times slower); some fail (server errors), some are
cancelled after their first token, and some users send bad requests (4xx). Arms are assigned by
user with the gateway's exponential race over the weights (serving/experiments/experiment.py), so a user keeps
an arm while the weights stay; a schedule of weights (rollout steps) starts a period each, and
load may drift from one to the next. The treatment arm (the second) can be slower, slower only in
its tail, or fail more.

Shared by tests/unit/test_ab_simulation.py (few runs, fixed seeds) and perf/ab_error_rates.py (the
table in docs/experiments.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np

from serving.experiments.request_log import RequestColumns
from serving.experiments.recorder import ExperimentRecorder
from serving.experiments.metrics import VerdictConfig
from serving.experiments.verdict import Verdict
from serving.experiments.experiment import Arm, Experiment
from serving.experiments.rollout import Rollout, RolloutPlan

ARMS = ("control", "treatment")
CHUNK = 4096


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    schedule: tuple[tuple[int, tuple[float, ...]], ...]  # (requests, weights) per period, in order
    users: int | None = 200  # None: no sticky key, each request a unit of its own
    zipf: float = 1.0  # user i's share of traffic ~ 1 / (i + 1)^zipf
    user_sigma: float = 0.3  # spread of users' log latency levels
    request_sigma: float = 0.4  # spread of a request's log TTFT around its user's level
    tail_share: float = 0.03  # requests slowed by about tail_factor
    tail_factor: float = 5.0
    error_rate: float = 0.0
    cancel_rate: float = 0.0
    bad_users: int = 0  # users (among the busiest 20) who send only malformed requests: 4xx
    drift: float = 0.0  # latencies grow by this share from one period to the next
    slower: float = 1.0  # the treatment's latencies times this
    treatment_tail_factor: float | None = None  # the treatment's tail slowdown (a tail-only regression)
    treatment_error_rate: float | None = None

    @property
    def requests(self) -> int:
        return sum(n for n, _ in self.schedule)

    def treated(self, **changes) -> Scenario:
        return replace(self, **changes)


class Traffic:
    """A scenario's users (latency levels, shares of traffic, arm draws) and their requests."""

    def __init__(self, scenario: Scenario, seed: int):
        self.scenario, self.rng = scenario, np.random.default_rng(seed)
        if scenario.users is not None:
            share = 1.0 / np.arange(1, scenario.users + 1) ** scenario.zipf
            self.share = share / share.sum()
            self.draws = self.rng.random((scenario.users, len(ARMS)))  # each user's draw per arm
            self.level = self.rng.normal(0, scenario.user_sigma, scenario.users)
            self.bad = self.rng.choice(min(20, scenario.users), scenario.bad_users, replace=False)
        self.next_user = 0  # without sticky keys: each request a user of its own

    def requests(self, n: int, weights: tuple[float, ...], period: int) -> RequestColumns:
        """n requests under these weights (control first), in period `period`."""
        s, rng = self.scenario, self.rng
        if s.users is None:
            user = self.next_user + np.arange(n)
            self.next_user += n
            draws, level = rng.random((n, len(ARMS))), rng.normal(0, s.user_sigma, n)
        else:
            user = rng.choice(s.users, n, p=self.share)
            draws, level = self.draws[user], self.level[user]
        with np.errstate(divide="ignore"):
            arm = np.argmin(-np.log(draws) / np.asarray(weights, dtype=float), axis=1)  # the exponential race
        treated = arm == 1
        load = (1 + s.drift) ** period * np.where(treated, s.slower, 1.0)
        tail_factor = np.where(treated, s.tail_factor if s.treatment_tail_factor is None else s.treatment_tail_factor,
                               s.tail_factor)

        def tail() -> np.ndarray:
            return np.where(rng.random(n) < s.tail_share, tail_factor * rng.lognormal(0, 0.5, n), 1.0)

        ttft = 0.08 * load * np.exp(level + rng.normal(0, s.request_sigma, n)) * tail()
        itl = 0.02 * load * np.exp(0.5 * level + rng.normal(0, 0.25, n)) * tail()
        e2e = ttft + itl * (rng.integers(16, 257, n) - 1)
        error_rate = np.where(treated, s.error_rate if s.treatment_error_rate is None else s.treatment_error_rate,
                              s.error_rate)
        status = np.full(n, "ok", dtype=object)
        status[rng.random(n) < s.cancel_rate] = "cancelled"
        status[rng.random(n) < error_rate] = "error"
        if s.users is not None and s.bad_users:
            status[np.isin(user, self.bad)] = "client_error"
        answered = (status == "ok") | (status == "cancelled")
        nan = np.full(n, np.nan)
        return RequestColumns(np.array(ARMS, dtype=object)[arm], user.astype(object), status,
                              np.full(n, period, np.int64), np.where(answered, ttft, nan),
                              np.where(answered, itl, nan), np.where(status == "ok", e2e, nan))


def simulate(scenario: Scenario, seed: int) -> RequestColumns:
    """One experiment's log, in arrival order: the schedule's periods one after the other."""
    traffic = Traffic(scenario, seed)
    parts = [traffic.requests(n, weights, period) for period, (n, weights) in enumerate(scenario.schedule)]
    return RequestColumns(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(RequestColumns)))


def run(scenario: Scenario, seed: int, config: VerdictConfig | None = None, until_decided: bool = False) -> Verdict:
    """The verdict over one simulated log, fed in chunks (a look after every request either way);
    until_decided: stop after the chunk in which the treatment was called better or worse."""
    columns = simulate(scenario, seed)
    verdict = Verdict(list(ARMS), config)
    for start in range(0, len(columns), CHUNK):
        verdict.add(columns[start:start + CHUNK])
        if until_decided and verdict.decision(ARMS[1])[0] != "no difference":
            break
    return verdict


def requests_per_arm(columns: RequestColumns, index: int | None) -> int | None:
    """The treatment's requests up to and including request `index`."""
    return None if index is None else int((columns.arm[:index + 1] == ARMS[1]).sum())


def rate_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Clopper-Pearson interval of a rate from k of n."""
    from scipy.stats import beta

    tail = (1 - confidence) / 2
    return (float(beta.ppf(tail, k, n - k + 1)) if k else 0.0,
            float(beta.ppf(1 - tail, k + 1, n - k)) if k < n else 1.0)


def a_a_scenarios(scale: float = 1.0) -> list[Scenario]:
    """The identical-arms scenarios of the table; scale shrinks the logs for fast runs."""
    def n(k: int) -> int:
        return max(int(k * scale), 200)

    return [
        Scenario("independent requests, lognormal, heavy tail, 50:50", ((n(4000), (50, 50)),), users=None),
        Scenario("200 sticky users, Zipf traffic, 50:50", ((n(4000), (50, 50)),)),
        Scenario("5,000 users, Zipf, 90:10", ((n(8000), (90, 10)),), users=5000, zipf=0.8),
        Scenario("20,000 users, Zipf, 99:1", ((n(40000), (99, 1)),), users=20000, zipf=0.6),
        Scenario("rollout 1 -> 10 -> 50 %, load +10 % a step, 5,000 users",
                 ((n(10000), (99, 1)), (n(3000), (90, 10)), (n(3000), (50, 50))), users=5000, zipf=0.8, drift=0.1),
        Scenario("errors 2 %, cancels 3 %, 2 users sending 4xx, 500 users",
                 ((n(6000), (50, 50)),), users=500, error_rate=0.02, cancel_rate=0.03, bad_users=2),
        Scenario("long experiment, 30,000 requests, 2,000 users", ((n(30000), (50, 50)),), users=2000, zipf=0.8),
    ]


@dataclass(frozen=True, slots=True)
class RolloutOutcome:
    outcome: str | None  # "rolled back", "done", or None: still going when the requests ran out
    percent: float  # the arm's share when it ended (before a rollback: the step it was rolled back at)
    requests: int
    reason: str


def simulate_rollout(scenario: Scenario, plan: RolloutPlan, seed: int, max_requests: int,
                     config: VerdictConfig | None = None) -> RolloutOutcome:
    """A guarded rollout of the treatment over simulated traffic (the scenario's schedule is not
    used: the rollout sets the weights). It is evaluated each time the arm could have served a
    quarter of min_requests more."""
    experiment = Experiment("simulated", (Arm(ARMS[0], "llm", 100.0), Arm(ARMS[1], "llm_b", 0.0)))
    recorder = ExperimentRecorder(experiment, config)
    rollout = Rollout(plan, recorder)
    traffic = Traffic(scenario, seed)
    served, percent, reason = 0, rollout.percent, ""
    while not rollout.finished and served < max_requests:
        weights = recorder.weights()
        n = max(1000, math.ceil(plan.min_requests / 4 / (weights[ARMS[1]] / 100)))
        recorder.add(traffic.requests(n, (weights[ARMS[0]], weights[ARMS[1]]), recorder.period))
        served += n
        before = rollout.percent
        decision = rollout.evaluate()
        percent, reason = before if decision.action == "rollback" else rollout.percent, decision.reason
    return RolloutOutcome(rollout.outcome, percent, served, reason)
