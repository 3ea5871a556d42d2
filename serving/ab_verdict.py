"""The verdict of an A/B experiment on one metric: each arm's percentiles with bootstrap intervals,
the difference, and a sequential test that stays valid however often it is looked at.

Latencies are compared on the log scale (a ratio of geometric means: "B's TTFT is 0.83x A's"),
throughputs too. The test is the mixture sequential probability ratio test (mSPRT; Robbins 1970,
as Johari, Pekelis and Walsh 2017 use it for always-valid A/B p-values): with d the difference of
the arms' mean log values, V = s_A^2 / n_A + s_B^2 / n_B its variance and a normal mixture
N(0, tau^2) over the true difference,

    Lambda_n = sqrt(V / (V + tau^2)) * exp(d^2 tau^2 / (2 V (V + tau^2)))

and the always-valid p-value is min over looks of 1 / Lambda. Declaring a difference when it falls
below alpha keeps the chance of ever declaring one between identical arms at alpha or less, for
any number of looks. tau is the size of effect the test is tuned to (0.1: about 10 %).

    B better / B worse        p < alpha, in the direction of d (lower is better for latencies)
    no difference yet         otherwise, with the requests per arm it would take to detect an
                              effect of `min_effect` at the current spread (`more_needed`)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

ALPHA = 0.05
TAU = 0.1  # the mixture's spread over log-ratio effects
MIN_EFFECT = 0.05  # "about N more requests needed" is for a 5 % effect
BOOTSTRAP = 2000
PERCENTILES = (50, 90, 99)


def log_lambda(d: float, v: float, tau: float = TAU) -> float:
    """log of the mSPRT's mixture likelihood ratio for difference d with variance v."""
    return 0.5 * math.log(v / (v + tau**2)) + d * d * tau**2 / (2 * v * (v + tau**2))


@dataclass(slots=True)
class SequentialTest:
    """The always-valid p-value of one metric, updated at each look."""
    alpha: float = ALPHA
    tau: float = TAU
    p_value: float = 1.0
    looks: int = 0

    def look(self, a: np.ndarray, b: np.ndarray) -> float:
        """a, b: each arm's log values so far. Returns the p-value (never rises)."""
        if len(a) >= 2 and len(b) >= 2:
            v = a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)
            if v > 0:
                self.p_value = min(self.p_value, math.exp(-max(log_lambda(b.mean() - a.mean(), v, self.tau), 0.0)))
        self.looks += 1
        return self.p_value


def more_needed(a: np.ndarray, b: np.ndarray, alpha: float = ALPHA, tau: float = TAU,
                min_effect: float = MIN_EFFECT) -> int:
    """Requests per arm beyond those there, until an effect of min_effect (log scale) at the
    current spread would cross the threshold."""
    s2 = (a.var(ddof=1) + b.var(ddof=1)) / 2 if len(a) > 1 and len(b) > 1 else 1.0
    d, n = math.log1p(min_effect), 2
    while log_lambda(d, 2 * s2 / n, tau) < math.log(1 / alpha) and n < 10**9:
        n = math.ceil(n * 1.1)
    return max(n - min(len(a), len(b)), 0)


@dataclass(slots=True)
class MetricVerdict:
    metric: str
    n: tuple[int, int]
    percentiles: dict[str, dict[int, tuple[float, float, float]]]  # arm -> p -> (value, low, high)
    ratio: tuple[float, float, float]  # B / A geometric means, with a 95 % bootstrap interval
    p_value: float
    verdict: str  # "B better", "B worse", "no difference yet"
    more_needed: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"metric": self.metric, "n": list(self.n), "ratio": list(self.ratio), "p_value": self.p_value,
                "verdict": self.verdict, "more_needed": self.more_needed,
                "percentiles": {arm: {str(p): list(v) for p, v in ps.items()} for arm, ps in self.percentiles.items()}}


def bootstrap_percentiles(x: np.ndarray, rng: np.random.Generator, rounds: int = BOOTSTRAP
                          ) -> dict[int, tuple[float, float, float]]:
    """Each percentile of x with its 95 % bootstrap interval."""
    samples = rng.choice(x, size=(rounds, len(x)), replace=True)
    out = {}
    for p in PERCENTILES:
        boots = np.percentile(samples, p, axis=1)
        out[p] = (float(np.percentile(x, p)), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5)))
    return out


def verdict(metric: str, a: np.ndarray, b: np.ndarray, test: SequentialTest, lower_is_better: bool = True,
            names: tuple[str, str] = ("A", "B"), seed: int = 0) -> MetricVerdict:
    """One look at arms A (control) and B on a positive metric (a latency, or tokens/s with
    lower_is_better False)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    rng = np.random.default_rng(seed)
    la, lb = np.log(a), np.log(b)
    p = test.look(la, lb)
    ratio_boots = [math.exp(rng.choice(lb, len(lb)).mean() - rng.choice(la, len(la)).mean()) for _ in range(500)] \
        if len(a) and len(b) else [math.nan]
    ratio = (math.exp(lb.mean() - la.mean()) if len(a) and len(b) else math.nan,
             float(np.percentile(ratio_boots, 2.5)), float(np.percentile(ratio_boots, 97.5)))
    percentiles = {names[0]: bootstrap_percentiles(a, rng) if len(a) else {},
                   names[1]: bootstrap_percentiles(b, rng) if len(b) else {}}
    if p < test.alpha:
        b_lower = lb.mean() < la.mean()
        kind = "B better" if b_lower == lower_is_better else "B worse"
        return MetricVerdict(metric, (len(a), len(b)), percentiles, ratio, p, kind)
    return MetricVerdict(metric, (len(a), len(b)), percentiles, ratio, p, "no difference yet",
                         more_needed(la, lb, test.alpha, test.tau))
