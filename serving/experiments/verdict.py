"""The verdict of an A/B experiment: each arm against the control, on every metric
(serving/experiments/metrics.py), kept up to date request by request from running statistics
(serving/experiments/sequential.py), and valid however often it is read.

Success metrics and guardrails are separated as in Spotify's risk-aware decision rule (Schultzberg,
Ankargren and Frånberg, arXiv 2402.11609):
    worse           some metric is significantly worse (a deterioration test, on every metric)
    better          no metric is worse, some success metric is significantly better, and every
                    guardrail is non-inferior: its confidence sequence's upper end is under its margin
    no difference   otherwise (yet)
Each of the K = metrics x (arms - 1) two-sided tests runs at alpha / K (Bonferroni), so the chance
that identical arms are ever called different, on any metric or arm, is at most alpha. The
non-inferiority bounds run at alpha / (arms - 1): a guardrail failing to pass only ever blocks.
Decisions are kept once made, with the index of the request after which they were made.
"""
from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass

import numpy as np

from serving.experiments.request_log import LATENCIES, RequestColumns
from serving.experiments.metrics import METRICS, TAIL_BURN_IN, TAIL_QUANTILE, VerdictConfig, VerdictError
from serving.experiments.sequential import Moments, UserMoments, compare, log_mixture_ratio, radius

MAX_SUM_ELEMENTS = 1 << 21  # [M, S, S, n] sums held at once while a batch is taken in
HISTOGRAM_EDGES = np.geomspace(1e-4, 1e3, 141)  # seconds: 20 bins a decade, for quantiles and ECDFs


@dataclass(slots=True)
class SequentialState:
    """One arm's test on one metric. Request indices count from 0 in arrival order."""
    p_value: float = 1.0  # always valid: the minimum over looks of 1 / Lambda
    decided_at: int | None = None  # the request after which the p-value first fell below its level
    direction: str | None = None  # "better" or "worse" once decided
    low: float = -math.inf  # the running intersection of the confidence sequence (theta's scale)
    high: float = math.inf
    theta: float = math.nan  # the latest estimate and its variance
    variance: float = math.nan
    non_inferior_bound: float = math.inf  # running minimum of the non-inferiority bound
    non_inferior_at: int | None = None  # the request after which it fell under the margin


class Verdict:
    """Running statistics of an experiment's requests and every arm's tests against the control."""

    def __init__(self, arms: list[str], config: VerdictConfig | None = None):
        if len(arms) < 2 or len(set(arms)) < len(arms):
            raise VerdictError("arms: the control first, then one or more other arms, no name twice")
        self.arms, self.config = list(arms), config or VerdictConfig()
        self.metrics = [METRICS[m] for m in self.config.tested]
        others = len(arms) - 1
        self.level = self.config.alpha / (len(self.metrics) * others)  # each two-sided test's
        self.non_inferior_level = self.config.alpha / others
        self.requests = 0
        self.user_index: dict = {}  # sticky key -> user index
        self.anonymous = itertools.count()  # a request without a key is a user of its own
        self.strata: dict[tuple[int, int], int] = {}  # (period, arm index) -> stratum
        self.periods: list[int] = []
        self.moments = UserMoments(len(self.metrics))
        self.weighted = np.array([m.weighted for m in self.metrics], bool)  # request-weighted metrics
        self.values = np.zeros(len(self.metrics), np.int64)  # values taken into each metric's test
        self.thresholds: dict[tuple[str, int], float] = {}  # (tail metric, period) -> seconds
        self.burn_in: dict[tuple[str, int], list[tuple[int, int, float]]] = {}  # -> (user, stratum, value)
        self.states = {(arm, m.name): SequentialState() for arm in self.arms[1:] for m in self.metrics}
        self.statuses: collections.Counter = collections.Counter()  # (arm, status) -> requests
        self.period_requests: collections.Counter = collections.Counter()  # (arm, period) -> requests but 4xx
        self.histograms = {(arm, c): np.zeros(len(HISTOGRAM_EDGES) + 1, np.int64) for arm in self.arms for c in LATENCIES}
        self.arm_users: list[set[int]] = [set() for _ in self.arms]

    @property
    def control(self) -> str:
        return self.arms[0]

    def add(self, batch: RequestColumns) -> None:
        """Take a batch of requests in arrival order; every test looks after each of them."""
        n = len(batch)
        if not n:
            return
        unknown = set(batch.arm.tolist()) - set(self.arms)
        if unknown:
            raise VerdictError(f"arm {sorted(unknown)[0]!r} is not in the experiment ({', '.join(self.arms)})")
        arms = np.array([self.arms.index(a) for a in batch.arm.tolist()], dtype=np.int64)
        users = self._user_ids(batch.user)
        strata = self._strata(batch.period, arms)
        self._count(batch, arms, users)
        values, valid = self._values(batch)
        # the batch in segments, cut where a tail threshold freezes, and small enough to hold
        # [M, S, S, n] sums: each segment's looks at once
        rows = max(64, MAX_SUM_ELEMENTS // (len(self.metrics) * max(len(self.strata), 1) ** 2))
        start = 0
        for cut, name, period in [*self._freezes(batch.period, valid), (n - 1, None, None)]:
            for first in range(start, cut + 1, rows):
                last = min(first + rows, cut + 1)
                self._segment(users[first:last], strata[first:last], batch.period[first:last],
                              values[:, first:last], valid[:, first:last], self.requests + first)
            if name is not None:
                self._freeze(name, period, self.requests + cut)
            start = cut + 1
        self.requests += n

    def _user_ids(self, keys: np.ndarray) -> np.ndarray:
        ids, known = self.user_index.setdefault, self.anonymous
        return np.fromiter((ids(("", next(known)) if k is None else k, len(self.user_index)) for k in keys.tolist()),
                           np.int64, len(keys))

    def _strata(self, periods: np.ndarray, arms: np.ndarray) -> np.ndarray:
        keys = list(zip(periods.tolist(), arms.tolist()))
        for key in dict.fromkeys(keys):
            if key not in self.strata:
                self.strata[key] = len(self.strata)
                if key[0] not in self.periods:
                    self.periods.append(key[0])
        return np.array([self.strata[k] for k in keys], dtype=np.int64)

    def _period_strata(self, arm: str, periods: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Each period's stratum for the control and for the arm (-1: none)."""
        periods = self.periods if periods is None else periods
        a, b = 0, self.arms.index(arm)
        return (np.array([self.strata.get((p, a), -1) for p in periods], dtype=np.int64),
                np.array([self.strata.get((p, b), -1) for p in periods], dtype=np.int64))

    def _count(self, batch: RequestColumns, arms: np.ndarray, users: np.ndarray) -> None:
        self.statuses.update(zip(batch.arm.tolist(), batch.status.tolist()))
        served = batch.status != "client_error"
        self.period_requests.update(zip(batch.arm[served].tolist(), batch.period[served].tolist()))
        for i, arm in enumerate(self.arms):
            mine = arms == i
            self.arm_users[i].update(users[mine].tolist())
            for column in LATENCIES:
                x = getattr(batch, column)[mine]
                x = x[np.isfinite(x)]
                self.histograms[(arm, column)] += np.bincount(np.searchsorted(HISTOGRAM_EDGES, x),
                                                              minlength=len(HISTOGRAM_EDGES) + 1)

    def _values(self, batch: RequestColumns) -> tuple[np.ndarray, np.ndarray]:
        """[M, n] each metric's value per request (a tail metric's: seconds, until thresholded)
        and whether the request has one."""
        status, n = batch.status, len(batch)
        ok, cancelled = status == "ok", status == "cancelled"
        values, valid = np.zeros((len(self.metrics), n)), np.zeros((len(self.metrics), n), bool)
        for i, metric in enumerate(self.metrics):
            if metric.kind == "rate":
                valid[i] = ok | cancelled | (status == "error")
                values[i] = status == "error"
                continue
            x = getattr(batch, metric.column)
            valid[i] = (ok if metric.column == "e2e_s" else ok | cancelled) & np.isfinite(x) & (x > 0)
            values[i] = np.log(x, where=valid[i], out=np.zeros(n)) if metric.kind == "log" else x
        return values, valid

    def _freezes(self, periods: np.ndarray, valid: np.ndarray) -> list[tuple[int, str, int]]:
        """Where in the batch each tail threshold still open gets its last burn-in value."""
        cuts = []
        for i, metric in enumerate(self.metrics):
            if metric.kind != "tail":
                continue
            for period in np.unique(periods[valid[i]]).tolist():
                if (metric.name, period) in self.thresholds:
                    continue
                need = TAIL_BURN_IN - len(self.burn_in.get((metric.name, period), ()))
                mine = np.flatnonzero(valid[i] & (periods == period))
                if len(mine) >= need:
                    cuts.append((int(mine[need - 1]), metric.name, period))
        return sorted(cuts)

    def _segment(self, users, strata, periods, values, valid, offset: int) -> None:
        """Requests offset.. (in arrival order) into the running statistics, and every look."""
        values, valid = values.copy(), valid.copy()
        for i, metric in enumerate(self.metrics):
            if metric.kind != "tail":
                continue
            for period in np.unique(periods[valid[i]]).tolist():
                mine = valid[i] & (periods == period)
                key = (metric.name, period)
                if key in self.thresholds:
                    values[i, mine] = values[i, mine] > self.thresholds[key]
                else:  # waits for the threshold
                    self.burn_in.setdefault(key, []).extend(zip(users[mine].tolist(), strata[mine].tolist(),
                                                                values[i, mine].tolist()))
                    valid[i, mine] = False
        self._take(users, strata, values, valid, offset + np.arange(len(users)))

    def _freeze(self, name: str, period: int, at: int) -> None:
        """Fix a tail threshold from its burn-in, and take the burn-in's values in at request `at`."""
        users, strata, seconds = (np.array(c) for c in zip(*self.burn_in.pop((name, period))))
        threshold = self.thresholds[(name, period)] = float(np.quantile(seconds, TAIL_QUANTILE))
        values, valid = np.zeros((len(self.metrics), len(users))), np.zeros((len(self.metrics), len(users)), bool)
        i = self.config.tested.index(name)
        values[i], valid[i] = seconds > threshold, True
        self._take(users.astype(np.int64), strata.astype(np.int64), values, valid, np.full(len(users), at))

    def _take(self, users, strata, values, valid, at: np.ndarray) -> None:
        moments = self.moments.add(users, strata, values, valid, len(self.strata), self.weighted)
        self.values += valid.sum(axis=1)
        for i, metric in enumerate(self.metrics):
            if not valid[i].any():
                continue
            for arm in self.arms[1:]:
                theta, v = compare(moments[i], *self._period_strata(arm), self.config.min_users, metric.kind != "log",
                                   metric.weighted)
                self._look(self.states[(arm, metric.name)], metric.name, theta, v, at)

    def _look(self, state: SequentialState, name: str, theta: np.ndarray, v: np.ndarray, at: np.ndarray) -> None:
        """Every look of a batch at once: running minimum p-value, the first crossing, the running
        intersection of the confidence sequence, the non-inferiority bound."""
        ready = np.isfinite(v)
        if not ready.any():
            return
        theta, v, at, taus = theta[ready], v[ready], at[ready], METRICS[name].taus
        p = np.minimum.accumulate(np.minimum(state.p_value, np.exp(-np.maximum(log_mixture_ratio(theta, v, taus), 0))))
        if state.decided_at is None and (crossed := np.flatnonzero(p <= self.level)).size:
            state.decided_at = int(at[crossed[0]])
            state.direction = "better" if theta[crossed[0]] < 0 else "worse"
        r = radius(v, taus, self.level)
        state.p_value = float(p[-1])
        state.low = max(state.low, float((theta - r).max()))
        state.high = min(state.high, float((theta + r).min()))
        state.theta, state.variance = float(theta[-1]), float(v[-1])
        if name in self.config.guardrails:
            bound = np.minimum.accumulate(np.minimum(state.non_inferior_bound,
                                                     theta + radius(v, taus, self.non_inferior_level)))
            if state.non_inferior_at is None and (passed := np.flatnonzero(bound < self.config.margin(name))).size:
                state.non_inferior_at = int(at[passed[0]])
            state.non_inferior_bound = float(bound[-1])

    def interval(self, arm: str, metric: str, periods: list[int], alpha: float) -> tuple[float, float] | None:
        """The difference arm - control on the metric over these periods alone, as it stands now,
        with the confidence sequence's radius at alpha; None before the first look."""
        m = self.moments
        if not m.num_strata:
            return None
        i = self.config.tested.index(metric)
        now = Moments(*(getattr(m, f)[i, ..., None] for f in ("C", "X", "P", "G", "N", "T")))
        theta, v = compare(now, *self._period_strata(arm, periods), self.config.min_users,
                           METRICS[metric].kind != "log", METRICS[metric].weighted)
        if not np.isfinite(v[0]):
            return None
        return float(theta[0]), float(radius(v, METRICS[metric].taus, alpha)[0])

    def users(self, arm: str, periods: list[int]) -> int:
        """The arm's users in these periods as the tests count them (the most over the metrics;
        a user in two periods counts twice)."""
        index = self.arms.index(arm)
        strata = [self.strata[(p, index)] for p in periods if (p, index) in self.strata]
        if not strata:
            return 0
        return int(self.moments.G[:, strata].sum(axis=1).max())

    def decision(self, arm: str) -> tuple[str, int | None]:
        """The arm's call (better, worse, no difference) and the request after which it was made."""
        states = {m: self.states[(arm, m)] for m in self.config.tested}
        worse = [s.decided_at for s in states.values() if s.direction == "worse"]
        if worse:
            return "worse", min(worse)
        wins = [states[m].decided_at for m in self.config.success if states[m].direction == "better"]
        guards = [states[m].non_inferior_at for m in self.config.guardrails]
        if wins and None not in guards:
            return "better", max([min(wins), *guards])
        return "no difference", None

    def quantile(self, arm: str, column: str, q: float) -> float | None:
        """The arm's q-quantile of a latency, from its histogram (log-linear within a bin)."""
        counts = self.histograms[(arm, column)]
        total = counts.sum()
        if not total:
            return None
        cumulative = np.cumsum(counts) / total
        j = int(np.searchsorted(cumulative, q))
        edges = np.r_[HISTOGRAM_EDGES[0], HISTOGRAM_EDGES, HISTOGRAM_EDGES[-1]]
        below = cumulative[j - 1] if j else 0.0
        share = (q - below) / max(cumulative[j] - below, 1e-12)
        return float(edges[j] * (edges[j + 1] / edges[j]) ** min(max(share, 0.0), 1.0))

    def metric_report(self, arm: str, name: str) -> dict:
        state, metric = self.states[(arm, name)], METRICS[name]
        shown = (lambda x: math.exp(x)) if metric.kind == "log" else (lambda x: x)
        low, high = state.low, state.high
        if low > high:  # an empty intersection: show the latest sequence instead
            r = float(radius(np.array(state.variance), metric.taus, self.level))
            low, high = state.theta - r, state.theta + r
        report = {"role": "success" if name in self.config.success else "guardrail", "scale": metric.scale,
                  "estimate": None if math.isnan(state.theta) else shown(state.theta),
                  "interval": None if math.isinf(low) or math.isinf(high) else [shown(low), shown(high)],
                  "p_value": state.p_value, "decided_at": state.decided_at, "direction": state.direction,
                  "values": int(self.values[self.config.tested.index(name)])}
        if name in self.config.guardrails:
            report |= {"margin": self.config.guardrails[name], "non_inferior_at": state.non_inferior_at}
        return report

    def report(self) -> dict:
        """The whole verdict, as JSON: O(arms x metrics x strata^2), whatever the requests."""
        arms = {}
        for arm in self.arms[1:]:
            decision, at = self.decision(arm)
            arms[arm] = {"decision": decision, "decided_at": at,
                         "metrics": {m: self.metric_report(arm, m) for m in self.config.tested}}
        return {"control": self.control, "requests": self.requests, "alpha": self.config.alpha,
                "level_per_test": self.level, "arms": arms,
                "users": {arm: len(self.arm_users[i]) for i, arm in enumerate(self.arms)},
                "statuses": {arm: {s: n for (a, s), n in sorted(self.statuses.items()) if a == arm} for arm in self.arms},
                "quantiles": {arm: {c.removesuffix("_s"): {str(q): self.quantile(arm, c, q / 100) for q in (50, 90, 99)}
                                    for c in LATENCIES} for arm in self.arms},
                "tail_thresholds": {f"{m}:{p}": c for (m, p), c in sorted(self.thresholds.items())}}
