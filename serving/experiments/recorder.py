"""What each arm of an A/B experiment gave its users, as the OpenAI gateway saw it, and the verdict
that reads it.

Each request that ends in the experiment is one line of the request log (serving/experiments/request_log.py), one
more request in the verdict's running statistics (serving/experiments/verdict.py), and one more in the
Prometheus families labelled `experiment` and `arm` (requests by finish reason or status, output
tokens, histograms of TTFT, ITL and end-to-end latency). A weight change starts a new period.

With a log, the recorder keeps LOG.weights.json beside it (the weights and the period) and on a
restart reads the log back through the verdict, so the verdict and the weights resume where they
were.
"""
from __future__ import annotations

import bisect
import collections
import json
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

from serving.experiments.request_log import LATENCIES, LoggedRequest, RequestColumns, RequestLog, hash_user, read_log
from serving.experiments.metrics import VerdictConfig
from serving.experiments.verdict import HISTOGRAM_EDGES, Verdict
from serving.experiments.experiment import Experiment, ExperimentError

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FLUSH_EVERY = 256  # requests held before the verdict takes them in (it looks after each either way)


def write_json(path: Path, values: dict) -> None:
    """Replace a small JSON file atomically (a crash leaves the old one or the new one)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(values, indent=1))
    os.replace(partial, path)


class ExperimentRecorder:
    def __init__(self, experiment: Experiment, config: VerdictConfig | None = None, log_path: str | Path | None = None):
        self.experiment = experiment
        self.verdict = Verdict([a.name for a in experiment.arms], config)
        self.period = 0
        self.pending: list[LoggedRequest] = []
        self.finishes: collections.Counter = collections.Counter()  # (arm, finish reason or status) -> requests
        self.histograms = {(a.name, m): [0] * (len(BUCKETS) + 1) for a in experiment.arms for m in LATENCIES}
        self.sums: collections.Counter = collections.Counter()  # (arm, latency) -> seconds
        self.tokens: collections.Counter = collections.Counter()  # arm -> output tokens
        self.lock = threading.RLock()  # a rollout holds it across its evaluation
        self.log_path = None if log_path is None else Path(log_path)
        self.weights_path = None if log_path is None else Path(f"{log_path}.weights.json")
        if self.log_path is not None:
            self._resume()
            self.log = RequestLog(self.log_path)

    def _resume(self) -> None:
        """Read an existing log back through the verdict; take the saved weights and period."""
        saved = json.loads(self.weights_path.read_text()) if self.weights_path.exists() else {}
        if saved and saved.get("experiment") != self.experiment.name:
            raise ExperimentError(f"{self.log_path} is experiment {saved.get('experiment')!r}'s log, not "
                                  f"{self.experiment.name!r}'s: give each experiment its own log")
        for records in read_log(self.log_path):
            records = [r for r in records if r["arm"] in self.verdict.arms]
            self.verdict.add(RequestColumns.from_records(records))
            self.period = max([self.period, *(int(r.get("period", 0)) for r in records)])
        if set(saved.get("weights", {})) == {a.name for a in self.experiment.arms}:
            self.experiment = self.experiment.with_weights(saved["weights"])
            self.period = max(self.period, int(saved["period"]))
        self._save()

    def _save(self) -> None:
        if self.weights_path is not None:
            write_json(self.weights_path, {"experiment": self.experiment.name, "period": self.period,
                                           "weights": self.weights()})

    def weights(self) -> dict[str, float]:
        return {a.name: a.weight for a in self.experiment.arms}

    def set_weights(self, weights: dict[str, float]) -> bool:
        """Change weights (ExperimentError if they cannot be); a change starts a new period."""
        with self.lock:
            changed = self.experiment.with_weights(weights)
            if changed == self.experiment:
                return False
            self._flush()
            self.experiment, self.period = changed, self.period + 1
            self._save()
            return True

    def record(self, arm: str, key: str | None, status: str, finish_reason: str | None = None,
               ttft: float | None = None, itl: float | None = None, e2e: float | None = None,
               output_tokens: int = 0) -> None:
        """One request that ended: status ok, error, client_error or cancelled (serving/experiments/request_log.py)."""
        with self.lock:
            request = LoggedRequest(time.time(), arm, hash_user(self.experiment.name, key), status, self.period,
                                    ttft, itl, e2e if status == "ok" else None, output_tokens)
            if self.log_path is not None:
                self.log.append(request)
            self.pending.append(request)
            self.finishes[(arm, finish_reason if status == "ok" and finish_reason else status)] += 1
            self.tokens[arm] += output_tokens
            for metric, value in zip(LATENCIES, (request.ttft_s, request.itl_s, request.e2e_s)):
                if value is not None:
                    self.histograms[(arm, metric)][bisect.bisect_left(BUCKETS, value)] += 1
                    self.sums[(arm, metric)] += value
            if len(self.pending) >= FLUSH_EVERY:
                self._flush()

    def add(self, batch: RequestColumns) -> None:
        """Requests straight into the verdict, as if recorded (simulations)."""
        with self.lock:
            self._flush()
            self.verdict.add(batch)

    def flush(self) -> None:
        with self.lock:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            records, self.pending = self.pending, []
            self.verdict.add(RequestColumns.from_records([asdict(r) for r in records]))

    def report(self) -> dict:
        """The verdict against the control, the weights and the period: O(arms x metrics)."""
        with self.lock:
            self._flush()
            return {"experiment": self.experiment.name, "weights": self.weights(), "period": self.period} | \
                self.verdict.report()

    def ecdf(self, column: str) -> dict:
        """Each arm's distribution of a latency: counts in the verdict's log-spaced bins."""
        with self.lock:
            self._flush()
            return {"edges": HISTOGRAM_EDGES.tolist(),
                    "counts": {arm: self.verdict.histograms[(arm, column)].tolist() for arm in self.verdict.arms}}

    def prometheus(self) -> str:
        """The text exposition of the per-arm families."""
        name = self.experiment.name
        lines = ["# TYPE specserve_ab_requests_total counter"]
        with self.lock:
            for (arm, reason), n in sorted(self.finishes.items()):
                lines.append(f'specserve_ab_requests_total{{experiment="{name}",arm="{arm}",finish_reason="{reason}"}} {n}')
            lines.append("# TYPE specserve_ab_output_tokens_total counter")
            arms = [a.name for a in self.experiment.arms]
            for arm in arms:
                lines.append(f'specserve_ab_output_tokens_total{{experiment="{name}",arm="{arm}"}} {self.tokens[arm]}')
            for metric in LATENCIES:
                family = f"specserve_ab_{metric.removesuffix('_s')}_seconds"
                lines.append(f"# TYPE {family} histogram")
                for arm in arms:
                    counts, total = self.histograms[(arm, metric)], 0
                    labels = f'experiment="{name}",arm="{arm}"'
                    for bound, count in zip((*BUCKETS, float("inf")), counts):
                        total += count
                        le = "+Inf" if bound == float("inf") else repr(bound)
                        lines.append(f'{family}_bucket{{{labels},le="{le}"}} {total}')
                    lines.append(f"{family}_sum{{{labels}}} {self.sums[(arm, metric)]}")
                    lines.append(f"{family}_count{{{labels}}} {total}")
        return "\n".join(lines) + "\n"
