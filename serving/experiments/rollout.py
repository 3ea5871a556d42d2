"""A guarded rollout of one arm: its share of traffic ramps up (e.g. 1 % -> 10 % -> 50 % -> 100 %)
while the verdict finds no harm, and drops to 0 at once when it does.

At each evaluation (serving/experiments/verdict.py holds the tests, looking after every request):
    rollback   the verdict calls the arm worse on any metric (a sequential deterioration test,
               family-wise over the metrics, stratified over the rollout's periods), or a request on
               the arm has gone `stall_timeout_s` without a token (an arm that hangs never answers)
    hold       the arm has served fewer than `min_requests` since the step began, or either arm
               has fewer users there than the verdict's first look needs
    advance    otherwise, to the next step
At the last step the control keeps `holdout` percent until every guardrail has passed its
non-inferiority test on that step's requests alone (the full load is where an arm that held at
10 % may break); then the arm gets the last step's share and the rollout is done. Every decision
carries its evidence.

The state (step, outcome, decisions) is saved to LOG.rollout.json beside the request log after
each decision, so a restarted gateway resumes the rollout: a rolled-back arm stays at 0.

The experiment file's "rollout": {"arm": "speculative", "steps": [1, 10, 50, 100], "min_requests": 200,
"holdout": 5, "stall_timeout_s": 120}
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from serving.experiments.recorder import ExperimentRecorder, write_json
from serving.experiments.metrics import METRICS, VerdictConfig, VerdictError
from serving.experiments.experiment import Experiment, ExperimentError


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    arm: str
    steps: tuple[float, ...] = (1.0, 10.0, 50.0, 100.0)  # the arm's percent of the traffic, in order
    min_requests: int = 200  # the arm's requests in a step before it may advance
    holdout: float = 5.0  # the control's percent at the last step until the guardrails pass there
    stall_timeout_s: float = 120.0  # a request on the arm this long without a token rolls it back

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
        if not 0 < plan.holdout < 50 or plan.min_requests < 1 or not plan.stall_timeout_s > 0:
            raise ExperimentError("rollout: holdout a percent in (0, 50), min_requests >= 1, stall_timeout_s > 0")
        return plan


def load_experiment(path: str | Path) -> tuple[Experiment, VerdictConfig, RolloutPlan | None]:
    """An experiment file: the experiment, its verdict's metrics ("metrics" key) and its rollout
    plan ("rollout" key), each checked."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExperimentError(f"{path}: {e}") from None
    if not isinstance(values, dict):
        raise ExperimentError(f"{path}: not an experiment (a JSON object)")
    experiment = Experiment.from_dict(values)
    try:
        config = VerdictConfig.from_dict(values.get("metrics", {}))
    except VerdictError as e:
        raise ExperimentError(str(e)) from None
    return experiment, config, RolloutPlan.from_dict(values["rollout"], experiment) if "rollout" in values else None


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
        self.outcome: str | None = None  # "rolled back" or "done" once it ends
        self.step_period = -1  # the first period of the current step
        self.bounds: dict[str, float] = {}  # guardrail -> lowest non-inferiority bound at the last step
        self.decisions: list[Decision] = []  # the moves (advance, rollback, done), in order
        self.latest: Decision | None = None  # the latest evaluation, a hold included
        self.path = None if recorder.log_path is None else Path(f"{recorder.log_path}.rollout.json")
        if self.path is not None and self.path.exists():
            self._resume(json.loads(self.path.read_text()))
        recorder.set_weights(self.weights())
        if self.step_period < 0:
            self.step_period = recorder.period
            self._save()

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    @property
    def percent(self) -> float:
        if self.outcome == "rolled back":
            return 0.0
        last = self.step == len(self.plan.steps) - 1
        share = self.plan.steps[self.step]
        return min(share, 100.0 - self.plan.holdout) if last and self.outcome is None else share

    def weights(self) -> dict[str, float]:
        """The experiment's weights now: the arm's percent, the rest the control's."""
        control = self.recorder.experiment.control.name
        return {a.name: 0.0 for a in self.recorder.experiment.arms} | {
            control: 100.0 - self.percent, self.plan.arm: self.percent}

    def evaluate(self, stalled_s: float = 0.0) -> Decision:
        """Judge the rollout now; stalled_s: how long the arm's oldest request in flight has gone
        without a token. Moves the weights on an advance, a rollback or the end."""
        with self.recorder.lock:
            self.latest = self._evaluate(stalled_s)
            return self.latest

    def _evaluate(self, stalled_s: float) -> Decision:
        if self.finished:
            return Decision("done", self.percent, f"the rollout has ended ({self.outcome})", {})
        verdict = self.recorder.verdict
        self.recorder.flush()
        requests = sum(n for (arm, period), n in verdict.period_requests.items()
                       if arm == self.plan.arm and period >= self.step_period)
        periods = [p for p in verdict.periods if p >= self.step_period]
        users = min(verdict.users(self.plan.arm, periods), verdict.users(verdict.control, periods))
        evidence = {"percent": self.percent, "step_requests": requests, "step_users": users,
                    "requests": verdict.requests}
        call, at = verdict.decision(self.plan.arm)
        if stalled_s > self.plan.stall_timeout_s:
            return self._end("rolled back", f"a request on the arm has had no token for {stalled_s:.0f} s "
                                            f"(limit {self.plan.stall_timeout_s:g} s)", evidence)
        if call == "worse":
            worse = {m: verdict.metric_report(self.plan.arm, m) for m in verdict.config.tested
                     if verdict.states[(self.plan.arm, m)].direction == "worse"}
            evidence |= {"decided_at": at, "worse": worse}
            return self._end("rolled back", "worse than the control on " + ", ".join(worse), evidence)
        if requests < self.plan.min_requests or users < verdict.config.min_users:
            return Decision("hold", self.percent, f"{requests} of {self.plan.min_requests} requests and {users} of "
                                                  f"{verdict.config.min_users} users (either arm) in this step", evidence)
        if self.step + 1 < len(self.plan.steps):
            self.step += 1
            return self._moved("advance", "no metric is worse", evidence)
        waiting = self._guardrails_waiting(evidence)
        if waiting:
            return Decision("hold", self.percent, "waiting for non-inferiority at the last step: " + ", ".join(waiting),
                            evidence)
        return self._end("done", "every guardrail is non-inferior at the last step", evidence)

    def _guardrails_waiting(self, evidence: dict) -> list[str]:
        """The guardrails not yet non-inferior over the last step's periods (running minimum of
        each bound over evaluations, at the verdict's non-inferiority level)."""
        verdict = self.recorder.verdict
        periods = [p for p in verdict.periods if p >= self.step_period]  # the last step's
        for metric in verdict.config.guardrails:
            look = verdict.interval(self.plan.arm, metric, periods, verdict.non_inferior_level)
            if look is not None:
                self.bounds[metric] = min(self.bounds.get(metric, math.inf), look[0] + look[1])
        margins = {m: verdict.config.margin(m) for m in verdict.config.guardrails}
        evidence["non_inferiority"] = {m: {"bound": _shown(m, self.bounds.get(m, math.inf)),
                                           "margin": verdict.config.guardrails[m]} for m in margins}
        return [m for m, margin in margins.items() if not self.bounds.get(m, math.inf) < margin]

    def _end(self, outcome: str, reason: str, evidence: dict) -> Decision:
        self.outcome = outcome
        return self._moved("rollback" if outcome == "rolled back" else "done", reason, evidence)

    def _moved(self, action: str, reason: str, evidence: dict) -> Decision:
        self.recorder.set_weights(self.weights())
        self.step_period, self.bounds = self.recorder.period, {}
        decision = Decision(action, self.percent, reason, evidence)
        self.decisions.append(decision)
        self._save()
        return decision

    def _save(self) -> None:
        if self.path is not None:
            write_json(self.path, {"experiment": self.recorder.experiment.name, "arm": self.plan.arm,
                                   "steps": list(self.plan.steps), "step": self.step, "outcome": self.outcome,
                                   "step_period": self.step_period,
                                   "decisions": [d.to_dict() for d in self.decisions]})

    def _resume(self, saved: dict) -> None:
        if (saved.get("experiment"), saved.get("arm"), saved.get("steps")) != \
                (self.recorder.experiment.name, self.plan.arm, list(self.plan.steps)):
            return  # another rollout's state: start afresh
        self.step, self.outcome = int(saved["step"]), saved.get("outcome")
        self.step_period = int(saved.get("step_period", -1))
        self.decisions = [Decision(**d) for d in saved.get("decisions", [])]

    def to_dict(self) -> dict:
        return {"arm": self.plan.arm, "step": self.step, "percent": self.percent, "finished": self.finished,
                "outcome": self.outcome, "decisions": [d.to_dict() for d in self.decisions],
                "latest": None if self.latest is None else self.latest.to_dict()}


def _shown(metric: str, bound: float) -> float | None:
    """A bound on the metric's own scale (a ratio for latencies)."""
    if math.isinf(bound):
        return None
    return math.exp(bound) if METRICS[metric].kind == "log" else bound
