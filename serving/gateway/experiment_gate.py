"""What the gateway does for an A/B experiment: the arm a request goes to, what it records, the
rollout it guards, and the admin's weight changes.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any

from fastapi import Request

from serving.experiments.experiment import Assignment, Experiment, ExperimentError
from serving.experiments.metrics import VerdictConfig
from serving.experiments.recorder import ExperimentRecorder
from serving.experiments.rollout import Rollout, RolloutPlan
from serving.gateway.protocol import OpenAIError
from serving.gateway.triton_generation import TritonGeneration
from serving.launch.launcher import ADMIN_HEADER  # the operator's admin key, as tritonserver's restricted APIs take it

log = logging.getLogger(__name__)
ROLLOUT_INTERVAL_S = 10.0


class ExperimentGate:
    """An A/B experiment in front of the arms: which arm serves a request, what it gave the user,
    the requests in flight on each arm (a rollout rolls back an arm that stops answering), and weight
    changes at run time (the admin key's, compared in constant time)."""

    def __init__(self, experiment: Experiment, admin_key: str | None, rollout: RolloutPlan | None = None,
                 config: VerdictConfig | None = None, log_path: str | None = None):
        self.recorder = ExperimentRecorder(experiment, config, log_path)  # holds the weights as they are now
        self.admin_key = admin_key
        self.rollout = Rollout(rollout, self.recorder) if rollout is not None else None
        self.in_flight: dict[TritonGeneration, str] = {}  # -> the arm serving it

    @property
    def experiment(self) -> Experiment:
        return self.recorder.experiment

    def stalled_s(self, arm: str) -> float:
        """How long the arm's longest-waiting request in flight has gone without a token."""
        now = time.monotonic()
        return max((now - (g.last_token_at or g.started) for g, a in self.in_flight.items()
                    if a == arm and g.reader is not None and not g.done.is_set()), default=0.0)

    async def guard_rollout(self, interval_s: float) -> None:
        """Judge the rollout every interval_s; it moves the weights on an advance or rollback."""
        while self.rollout is not None and not self.rollout.finished:
            await asyncio.sleep(interval_s)
            decision = self.rollout.evaluate(self.stalled_s(self.rollout.plan.arm))
            if decision.action != "hold":
                log.info("experiment %s rollout: %s to %s%% (%s): %s", self.experiment.name, decision.action,
                         decision.percent, decision.reason, json.dumps(decision.evidence))

    def report(self) -> dict:
        report = self.recorder.report()
        if self.rollout is not None:
            report["rollout"] = self.rollout.to_dict()
        return report

    def key(self, request: Request, body: dict) -> str | None:
        source = self.experiment.sticky_key
        if source == "user":
            key = body.get("user")
        elif source.startswith("header:"):
            key = request.headers.get(source.split(":", 1)[1])
        else:
            key = body.get(source.split(":", 1)[1])
        return str(key) if key is not None else None

    def start(self, assignment: Assignment, generation: TritonGeneration) -> None:
        if assignment.in_experiment:
            self.in_flight[generation] = assignment.arm.name

    def record(self, assignment: Assignment, key: str | None, generation: TritonGeneration, status: str,
               finish_reason: str | None = None) -> None:
        """How a request ended: status ok, error, client_error (a 4xx) or cancelled; once a request."""
        if self.in_flight.pop(generation, None) is None:
            return  # held out, or already recorded
        first, last, n = generation.first_token_at, generation.last_token_at, generation.output_tokens
        self.recorder.record(assignment.arm.name, key, status, finish_reason,
                             None if first is None else first - generation.started,
                             (last - first) / (n - 1) if first is not None and n > 1 else None,
                             time.monotonic() - generation.started, n)

    def set_weights(self, request: Request, weights: Any) -> None:
        given = request.headers.get(ADMIN_HEADER, "")
        if self.admin_key is None or not hmac.compare_digest(given.encode(), self.admin_key.encode()):
            raise OpenAIError(f"changing an experiment needs the admin key (header {ADMIN_HEADER})", 403,
                              kind="permission_error")
        if not isinstance(weights, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                    for v in weights.values()):
            raise OpenAIError('the body must be {"weights": {arm: number, ...}}', param="weights")
        if self.rollout is not None and not self.rollout.finished:
            raise OpenAIError("a rollout sets the weights until it ends", 409, param="weights")
        try:
            self.recorder.set_weights(weights)
        except ExperimentError as e:
            raise OpenAIError(str(e), param="weights") from None
