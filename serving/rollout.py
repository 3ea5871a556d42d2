"""A guarded rollout of one arm: its share of traffic ramps up (e.g. 1 % -> 10 % -> 50 % -> 100 %)
only while guardrails hold against the control, and drops to 0 at once when one breaks.

At each evaluation, over the requests since the current step began (the arm needs at least
`min_requests` of them before the step can be judged; a break is acted on as soon as it is seen):
    error rate    the arm's minus the control's, at most `max_error_rate_increase`
    TTFT p99      the arm's over the control's, at most `max_ttft_p99_ratio`
    ITL p99       the arm's over the control's, at most `max_itl_p99_ratio`
(the p99s once both arms have `min_tail_requests`). All hold with `min_requests` in: the next step;
one breaks: rollback (weight 0) and the rollout ends. Every decision carries its evidence.

The experiment file's "rollout": {"arm": "speculative", "steps": [1, 10, 50, 100], "min_requests": 200,
"max_error_rate_increase": 0.01, "max_ttft_p99_ratio": 1.2, "max_itl_p99_ratio": 1.2}
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from serving.ab_recorder import ExperimentRecorder, RequestRecord
from serving.experiment import Experiment, ExperimentError


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    arm: str
    steps: tuple[float, ...] = (1.0, 10.0, 50.0, 100.0)  # the arm's percent of the traffic, in order
    min_requests: int = 200
    min_tail_requests: int = 100
    max_error_rate_increase: float = 0.01
    max_ttft_p99_ratio: float = 1.2
    max_itl_p99_ratio: float = 1.2

    @classmethod
    def from_dict(cls, values: dict, experiment: Experiment) -> RolloutPlan:
        try:
            plan = cls(**{k: tuple(v) if k == "steps" else v for k, v in values.items()})
        except TypeError as e:
            raise ExperimentError(f"rollout: {e}") from None
        if plan.arm not in [a.name for a in experiment.arms[1:]]:
            raise ExperimentError("rollout: arm must name an arm other than the control (the first)")
        if not plan.steps or any(not 0 < s <= 100 for s in plan.steps) or list(plan.steps) != sorted(plan.steps):
            raise ExperimentError("rollout: steps must be rising percents in (0, 100]")
        return plan


def load_experiment(path: str | Path) -> tuple[Experiment, RolloutPlan | None]:
    """An experiment file: the experiment, and its rollout plan when it has a "rollout" key."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExperimentError(f"{path}: {e}") from None
    if not isinstance(values, dict):
        raise ExperimentError(f"{path}: not an experiment (a JSON object)")
    experiment = Experiment.from_dict(values)
    return experiment, RolloutPlan.from_dict(values["rollout"], experiment) if "rollout" in values else None


@dataclass(slots=True)
class Decision:
    action: str  # "hold", "advance", "rollback", "done"
    percent: float  # the arm's share after it
    reason: str
    evidence: dict
    at: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return {"action": self.action, "percent": self.percent, "reason": self.reason, "evidence": self.evidence,
                "at": self.at}


class Rollout:
    def __init__(self, plan: RolloutPlan, recorder: ExperimentRecorder):
        self.plan, self.recorder = plan, recorder
        self.step = 0
        self.finished = False
        self.decisions: list[Decision] = []
        self.started_at = self._counts()  # requests recorded per arm when the current step began

    @property
    def percent(self) -> float:
        return 0.0 if self.finished and self.decisions and self.decisions[-1].action == "rollback" \
            else self.plan.steps[self.step]

    def weights(self) -> dict[str, float]:
        """The experiment's weights for the current step: the arm's percent, the rest the control's."""
        control = self.recorder.experiment.control.name
        return {a.name: 0.0 for a in self.recorder.experiment.arms} | {
            control: 100.0 - self.percent, self.plan.arm: self.percent}

    def evaluate(self) -> Decision:
        """Judge the current step; the caller applies `weights()` after an advance or a rollback."""
        if self.finished:
            return Decision("done", self.percent, "the rollout has ended", {})
        control = self.recorder.experiment.control.name
        since = self._counts()
        arm = self._since(self.plan.arm, since)
        base = self._since(control, since)
        evidence = {"requests": {self.plan.arm: len(arm), control: len(base)}, "percent": self.percent}
        broken = self._broken(arm, base, evidence)
        if broken:
            decision = Decision("rollback", 0.0, broken, evidence)
            self.finished = True
        elif len(arm) < self.plan.min_requests:
            return Decision("hold", self.percent, f"{len(arm)} of {self.plan.min_requests} requests in this step",
                            evidence)
        elif self.step + 1 < len(self.plan.steps):
            self.step += 1
            self.started_at = since
            decision = Decision("advance", self.percent, "every guardrail holds", evidence)
        else:
            self.finished = True
            decision = Decision("done", self.percent, "every guardrail held at the last step", evidence)
        self.decisions.append(decision)
        return decision

    def _counts(self) -> dict[str, int]:
        with self.recorder.lock:
            return {arm: sum(n for (a, _), n in self.recorder.finishes.items() if a == arm)
                    for arm in self.recorder.records}

    def _since(self, arm: str, now: dict[str, int]) -> list[RequestRecord]:
        new = now[arm] - self.started_at.get(arm, 0)
        with self.recorder.lock:
            records = list(self.recorder.records[arm])
        return records[len(records) - min(new, len(records)):] if new > 0 else []

    def _broken(self, arm: list[RequestRecord], base: list[RequestRecord], evidence: dict) -> str | None:
        plan = self.plan
        if arm and base:
            rate = sum(r.finish_reason == "error" for r in arm) / len(arm)
            base_rate = sum(r.finish_reason == "error" for r in base) / len(base)
            evidence["error_rate"] = {"arm": rate, "control": base_rate}
            # a break needs more than one unlucky request: at least 3 errors in the arm
            if rate - base_rate > plan.max_error_rate_increase and sum(r.finish_reason == "error" for r in arm) >= 3:
                return f"error rate {rate:.3f} against the control's {base_rate:.3f}"
        for metric, limit in (("ttft", plan.max_ttft_p99_ratio), ("itl", plan.max_itl_p99_ratio)):
            a = [getattr(r, metric) for r in arm if getattr(r, metric) is not None]
            b = [getattr(r, metric) for r in base if getattr(r, metric) is not None]
            if len(a) >= plan.min_tail_requests and len(b) >= plan.min_tail_requests:
                ratio = float(np.percentile(a, 99) / np.percentile(b, 99))
                evidence[f"{metric}_p99_ratio"] = ratio
                if ratio > limit:
                    return f"{metric} p99 is {ratio:.2f}x the control's (limit {limit}x)"
        return None
