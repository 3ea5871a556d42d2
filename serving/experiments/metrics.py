"""What an A/B experiment's verdict measures and how it decides (serving/experiments/verdict.py runs it).

Metrics (all lower is better; each request's value, analysed per user: serving/experiments/sequential.py):
    ttft, itl, e2e   log seconds: the estimate is the ratio of the arms' geometric means (B / A)
    errors           1 if the server failed the request, 0 if it answered or the client left
                     (a 4xx is the client's mistake and counts for no arm)
    ttft_tail,       1 if the value exceeds the period's pooled 99th percentile, frozen from the
    itl_tail         period's first TAIL_BURN_IN values of both arms together (so the same for
                     either arm between identical arms): the estimate is the difference of the
                     shares of requests above it (request-weighted, with a variance over users:
                     an event in 1 % of requests is rare per user, so users' own shares of it
                     would waste most of the requests). A sequential test of a quantile as in Howard and Ramdas
                     (arXiv 1906.09712) and Lindon, Sanden and Shirikian's canary tests (KDD 2022,
                     arXiv 2205.14762): a p99 regression moves this share whatever the median does.

The experiment file's "metrics" names the success metrics and the guardrails with their margins:
    {"success": ["itl", "e2e"], "guardrails": {"errors": 0.01, "ttft": 1.05}, "alpha": 0.05}
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

ALPHA = 0.05
MIN_USERS = 20  # per arm and period before a period enters a test: the first look
TAIL_QUANTILE = 0.99
TAIL_BURN_IN = 1000
TAUS = 5  # each metric's mixture: tau, 2 tau, ... 16 tau


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    column: str  # the log's field it is computed from
    kind: str  # "log": mean log value; "rate": share of server errors; "tail": share above a quantile
    tau: float  # the smallest of the mixture's spreads (the effect sizes the test is tuned to)
    weighted: bool = False  # the share of requests (each counts), not the mean of users' shares

    @property
    def taus(self) -> tuple[float, ...]:
        return tuple(self.tau * 2**j for j in range(TAUS))

    @property
    def scale(self) -> str:
        return "ratio" if self.kind == "log" else "difference"


METRICS = {m.name: m for m in (
    Metric("ttft", "ttft_s", "log", 0.025), Metric("itl", "itl_s", "log", 0.025), Metric("e2e", "e2e_s", "log", 0.025),
    Metric("errors", "status", "rate", 0.01),
    Metric("ttft_tail", "ttft_s", "tail", 0.005, weighted=True), Metric("itl_tail", "itl_s", "tail", 0.005, weighted=True))}
DEFAULT_SUCCESS = ("ttft", "itl", "e2e")
DEFAULT_GUARDRAILS = {"errors": 0.01, "ttft_tail": 0.01, "itl_tail": 0.01}


class VerdictError(ValueError):
    """A verdict configuration that cannot be used; the message says why."""


@dataclass(frozen=True)
class VerdictConfig:
    """Which metrics decide, and how. Margins are ratios for latencies (1.05: 5 % slower at most),
    differences of shares otherwise (0.01: one point more at most)."""
    alpha: float = ALPHA
    success: tuple[str, ...] = DEFAULT_SUCCESS
    guardrails: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_GUARDRAILS))  # metric -> margin
    min_users: int = MIN_USERS

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 0.5:
            raise VerdictError("alpha: a level in (0, 0.5)")
        unknown = [m for m in (*self.success, *self.guardrails) if m not in METRICS]
        if unknown:
            raise VerdictError(f"metric {unknown[0]!r}: one of {', '.join(METRICS)}")
        if not self.success or set(self.success) & set(self.guardrails) or len(set(self.success)) < len(self.success):
            raise VerdictError("success: one or more metrics, none of them also a guardrail")
        for name, margin in self.guardrails.items():
            low = 1.0 if METRICS[name].kind == "log" else 0.0
            if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not margin > low:
                raise VerdictError(f"guardrails: {name}'s margin must be a number above {low:g}")
        if not isinstance(self.min_users, int) or self.min_users < 2:
            raise VerdictError("min_users: an integer, at least 2")

    @classmethod
    def from_dict(cls, values: dict) -> VerdictConfig:
        if not isinstance(values, dict) or set(values) - {"alpha", "success", "guardrails", "min_users"}:
            raise VerdictError('metrics: {"success": [...], "guardrails": {metric: margin}, "alpha", "min_users"}')
        try:
            return cls(values.get("alpha", ALPHA), tuple(values.get("success", DEFAULT_SUCCESS)),
                       dict(values.get("guardrails", DEFAULT_GUARDRAILS)), values.get("min_users", MIN_USERS))
        except (TypeError, ValueError) as e:
            raise VerdictError(f"metrics: {e}") from None

    @property
    def tested(self) -> tuple[str, ...]:
        return (*self.success, *self.guardrails)

    def margin(self, metric: str) -> float:
        """The guardrail's margin on the scale of the test (log for latencies)."""
        margin = self.guardrails[metric]
        return math.log(margin) if METRICS[metric].kind == "log" else margin
