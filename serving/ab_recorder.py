"""What each arm of an A/B experiment gave its users, as the OpenAI gateway saw it: per request
TTFT, inter-token latency, end-to-end latency, output tokens/s, finish reason or error.

Kept as Prometheus families labelled `experiment` and `arm` (counters, and histograms of the three
latencies) and as a bounded log of the last `max_records` requests per arm, which the verdict
(serving/ab_verdict.py) reads.
"""
from __future__ import annotations

import bisect
import collections
import threading
from dataclasses import dataclass

import numpy as np

from serving.ab_verdict import SequentialTest, verdict
from serving.experiment import Experiment

MAX_RECORDS = 50_000  # per arm
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCIES = ("ttft", "itl", "e2e")
METRICS = {"ttft": True, "itl": True, "e2e": True, "tokens_per_s": False}  # name -> lower is better


@dataclass(frozen=True, slots=True)
class RequestRecord:
    arm: str
    ttft: float | None  # seconds to the first token; None: no token came
    itl: float | None  # mean seconds between tokens after the first; None: fewer than 2 tokens
    e2e: float
    output_tokens: int
    finish_reason: str  # "stop", "length", ... or "error"

    @property
    def tokens_per_s(self) -> float | None:
        return self.output_tokens / self.e2e if self.output_tokens and self.e2e > 0 else None


class ExperimentRecorder:
    def __init__(self, experiment: Experiment, max_records: int = MAX_RECORDS):
        self.experiment = experiment
        self.records = {arm.name: collections.deque(maxlen=max_records) for arm in experiment.arms}
        self.finishes: collections.Counter = collections.Counter()  # (arm, finish reason) -> requests
        self.histograms = {(arm.name, m): [0] * (len(BUCKETS) + 1) for arm in experiment.arms for m in LATENCIES}
        self.sums: collections.Counter = collections.Counter()  # (arm, metric) -> seconds
        self.tokens: collections.Counter = collections.Counter()  # arm -> output tokens
        self.tests = {(arm.name, m): SequentialTest() for arm in experiment.arms[1:] for m in METRICS}
        self.lock = threading.Lock()

    def record(self, record: RequestRecord) -> None:
        with self.lock:
            self.records[record.arm].append(record)
            self.finishes[(record.arm, record.finish_reason)] += 1
            self.tokens[record.arm] += record.output_tokens
            for metric in LATENCIES:
                value = getattr(record, metric)
                if value is not None:
                    self.histograms[(record.arm, metric)][bisect.bisect_left(BUCKETS, value)] += 1
                    self.sums[(record.arm, metric)] += value

    def values(self, arm: str, metric: str) -> np.ndarray:
        with self.lock:
            values = [getattr(r, metric) for r in self.records[arm] if r.finish_reason != "error"]
        return np.array([v for v in values if v is not None and v > 0], dtype=float)

    def report(self) -> dict:
        """Each arm against the control, per metric: percentiles, the ratio, the verdict."""
        control = self.experiment.control.name
        arms = {}
        for arm in self.experiment.arms[1:]:
            metrics = {}
            for metric, lower_is_better in METRICS.items():
                a, b = self.values(control, metric), self.values(arm.name, metric)
                if len(a) < 2 or len(b) < 2:
                    metrics[metric] = {"verdict": "no data yet", "n": [len(a), len(b)]}
                    continue
                with self.lock:
                    test = self.tests[(arm.name, metric)]
                metrics[metric] = verdict(metric, a, b, test, lower_is_better, (control, arm.name)).to_dict()
            arms[arm.name] = metrics
        with self.lock:
            finishes = {arm.name: {reason: n for (a, reason), n in self.finishes.items() if a == arm.name}
                        for arm in self.experiment.arms}
        return {"experiment": self.experiment.name, "control": control,
                "weights": {a.name: a.weight for a in self.experiment.arms},
                "requests": finishes, "versus_control": arms}

    def prometheus(self) -> str:
        """The text exposition of the per-arm families."""
        name = self.experiment.name
        lines = ["# TYPE specserve_ab_requests_total counter"]
        with self.lock:
            for (arm, reason), n in sorted(self.finishes.items()):
                lines.append(f'specserve_ab_requests_total{{experiment="{name}",arm="{arm}",finish_reason="{reason}"}} {n}')
            lines.append("# TYPE specserve_ab_output_tokens_total counter")
            for arm in self.records:
                lines.append(f'specserve_ab_output_tokens_total{{experiment="{name}",arm="{arm}"}} {self.tokens[arm]}')
            for metric in LATENCIES:
                family = f"specserve_ab_{metric}_seconds"
                lines.append(f"# TYPE {family} histogram")
                for arm in self.records:
                    counts, total = self.histograms[(arm, metric)], 0
                    labels = f'experiment="{name}",arm="{arm}"'
                    for bound, count in zip((*BUCKETS, float("inf")), counts):
                        total += count
                        le = "+Inf" if bound == float("inf") else repr(bound)
                        lines.append(f'{family}_bucket{{{labels},le="{le}"}} {total}')
                    lines.append(f"{family}_sum{{{labels}}} {self.sums[(arm, metric)]}")
                    lines.append(f"{family}_count{{{labels}}} {total}")
        return "\n".join(lines) + "\n"
