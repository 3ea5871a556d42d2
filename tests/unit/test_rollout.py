"""Guarded rollouts (serving/experiments/rollout.py) over simulated traffic: steps, rollbacks with evidence,
the control's holdout at the last step, a hung arm, and a restart that resumes. Rates over many
rollouts: tests/unit/test_ab_simulation.py."""
from __future__ import annotations

import json

import pytest

from perf.ab_simulation import ARMS, Scenario, Traffic
from serving.experiments.recorder import ExperimentRecorder
from serving.experiments.metrics import VerdictConfig
from serving.experiments.experiment import Experiment
from serving.experiments.rollout import Rollout, RolloutPlan

EXPERIMENT = Experiment.from_dict({"name": "guarded", "arms": [
    {"name": ARMS[0], "model": "llm", "weight": 100}, {"name": ARMS[1], "model": "llm_b", "weight": 0}]})
# guardrails a few thousand requests can pass: errors within 3 points, TTFT within 20 %
CONFIG = VerdictConfig(success=("itl",), guardrails={"errors": 0.03, "ttft": 1.2})
PLAN = RolloutPlan(ARMS[1], (10.0, 50.0, 100.0), min_requests=100, holdout=10.0, stall_timeout_s=60)


def _serve(recorder: ExperimentRecorder, traffic: Traffic, n: int) -> None:
    weights = recorder.weights()
    recorder.add(traffic.requests(n, (weights[ARMS[0]], weights[ARMS[1]]), recorder.period))


def _run(rollout: Rollout, recorder: ExperimentRecorder, traffic: Traffic, evaluations: int, n: int = 500) -> list:
    decisions = []
    for _ in range(evaluations):
        if rollout.finished:
            break
        _serve(recorder, traffic, n)
        decisions.append(rollout.evaluate())
    return decisions


def test_a_healthy_arm_ramps_and_the_control_keeps_its_holdout_until_the_guardrails_pass():
    recorder = ExperimentRecorder(EXPERIMENT, CONFIG)
    rollout = Rollout(PLAN, recorder)
    assert recorder.weights() == {ARMS[0]: 90.0, ARMS[1]: 10.0} and recorder.period == 1
    decisions = _run(rollout, recorder, Traffic(Scenario("same", (), users=3000, zipf=0.6), 0), 40)
    moves = [(d.action, d.percent) for d in decisions if d.action != "hold"]
    assert moves == [("advance", 50.0), ("advance", 90.0), ("done", 100.0)], moves
    waiting = [d for d in decisions if d.percent == 90.0 and d.action == "hold"]
    assert waiting and all("non-inferiority" in d.reason or "users" in d.reason for d in waiting)
    done = decisions[-1]
    assert set(done.evidence["non_inferiority"]) == {"errors", "ttft"}
    assert all(v["bound"] < v["margin"] for v in done.evidence["non_inferiority"].values())
    assert recorder.weights() == {ARMS[0]: 0.0, ARMS[1]: 100.0} and rollout.finished
    assert rollout.evaluate().action == "done"


@pytest.mark.parametrize("harm,metric", [(dict(treatment_error_rate=0.2), "errors"), (dict(slower=2.0), "ttft")])
def test_a_harmful_arm_rolls_back_at_once_with_its_evidence(harm, metric):
    recorder = ExperimentRecorder(EXPERIMENT, CONFIG)
    rollout = Rollout(PLAN, recorder)
    decisions = _run(rollout, recorder, Traffic(Scenario("harm", (), users=3000, zipf=0.6, **harm), 1), 20)
    last = decisions[-1]
    assert last.action == "rollback" and last.percent == 0.0 and metric in last.reason
    assert metric in last.evidence["worse"] and last.evidence["worse"][metric]["direction"] == "worse"
    assert [d.percent for d in decisions[:-1]] == [10.0] * (len(decisions) - 1)  # never past its first step
    assert recorder.weights() == {ARMS[0]: 100.0, ARMS[1]: 0.0}
    assert rollout.evaluate().action == "done"


def test_the_last_step_is_guarded_the_control_keeps_traffic_there():
    """The arm turns bad once it has the most traffic: the holdout still sees it."""
    recorder = ExperimentRecorder(EXPERIMENT, CONFIG)
    rollout = Rollout(PLAN, recorder)
    traffic = Traffic(Scenario("same", (), users=3000, zipf=0.6), 2)
    while rollout.percent < 90.0:
        _run(rollout, recorder, traffic, 1)
    bad = Traffic(Scenario("broken", (), users=3000, zipf=0.6, treatment_error_rate=1.0), 2)
    decisions = _run(rollout, recorder, bad, 10)
    assert decisions[-1].action == "rollback" and "errors" in decisions[-1].reason
    assert all(d.percent == 90.0 for d in decisions[:-1])


def test_an_arm_that_stops_answering_is_rolled_back():
    recorder = ExperimentRecorder(EXPERIMENT, CONFIG)
    rollout = Rollout(PLAN, recorder)
    assert rollout.evaluate(stalled_s=59.0).action == "hold"
    assert rollout.to_dict()["latest"]["action"] == "hold" and rollout.to_dict()["decisions"] == []  # a hold is no move
    decision = rollout.evaluate(stalled_s=61.0)
    assert decision.action == "rollback" and "no token for 61 s" in decision.reason
    assert recorder.weights()[ARMS[1]] == 0.0
    assert rollout.to_dict()["latest"] == rollout.to_dict()["decisions"][-1] == decision.to_dict()


def test_a_restart_resumes_the_rollout_and_a_rolled_back_arm_stays_at_zero(tmp_path):
    log = tmp_path / "experiment.jsonl"
    recorder = ExperimentRecorder(EXPERIMENT, CONFIG, log)
    rollout = Rollout(PLAN, recorder)
    traffic = Traffic(Scenario("same", (), users=3000, zipf=0.6), 3)
    while rollout.percent < 50.0:
        _run(rollout, recorder, traffic, 1)
        for _ in range(3):  # the gateway's path: one logged request at a time
            recorder.record(ARMS[0], "someone", "ok", "stop", 0.05, 0.02, 1.0, 40)
    period, requests = recorder.period, recorder.verdict.requests

    # the simulated requests bypassed the log: a restart rebuilds the verdict from what was logged
    again = ExperimentRecorder(EXPERIMENT, CONFIG, log)
    resumed = Rollout(PLAN, again)
    assert (resumed.step, resumed.percent, again.period) == (1, 50.0, period)
    assert again.weights() == {ARMS[0]: 50.0, ARMS[1]: 50.0}
    assert again.verdict.requests == sum(1 for _ in open(log)) < requests

    assert resumed.evaluate(stalled_s=600).action == "rollback"
    saved = json.loads((tmp_path / "experiment.jsonl.rollout.json").read_text())
    assert saved["outcome"] == "rolled back" and saved["decisions"][-1]["action"] == "rollback"
    third = Rollout(PLAN, ExperimentRecorder(EXPERIMENT, CONFIG, log))
    assert third.finished and third.percent == 0.0
    assert third.recorder.weights() == {ARMS[0]: 100.0, ARMS[1]: 0.0}
    assert [d.action for d in third.decisions][-1] == "rollback"


def test_another_rollouts_saved_state_is_not_taken(tmp_path):
    log = tmp_path / "experiment.jsonl"
    Rollout(PLAN, ExperimentRecorder(EXPERIMENT, CONFIG, log)).evaluate(stalled_s=600)
    other = RolloutPlan(ARMS[1], (5.0, 100.0), min_requests=100)
    fresh = Rollout(other, ExperimentRecorder(EXPERIMENT, CONFIG, log))
    assert not fresh.finished and fresh.percent == 5.0


def test_a_log_belongs_to_one_experiment(tmp_path):
    from serving.experiments.experiment import ExperimentError

    log = tmp_path / "experiment.jsonl"
    ExperimentRecorder(EXPERIMENT, CONFIG, log)
    other = Experiment.from_dict({"name": "another", "arms": [{"name": ARMS[0], "model": "llm"},
                                                              {"name": ARMS[1], "model": "llm_b"}]})
    with pytest.raises(ExperimentError, match="its own log"):
        ExperimentRecorder(other, CONFIG, log)
