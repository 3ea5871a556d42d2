"""A/B experiments: sticky weighted assignment (serving/experiment.py) and the always-valid
sequential verdict (serving/ab_verdict.py)."""
from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import numpy as np
import pytest

from serving.ab_verdict import SequentialTest, more_needed, verdict
from serving.experiment import Experiment, ExperimentError
from serving.rollout import load_experiment

SPEC = {"name": "spec-on-off", "arms": [{"name": "control", "model": "llm", "weight": 90},
                                        {"name": "speculative", "model": "llm_b", "weight": 10}]}


def test_assignment_is_sticky_and_follows_the_weights():
    experiment = Experiment.from_dict(SPEC)
    keys = [f"user-{i}" for i in range(2000)]
    first = [experiment.assign(k).arm.name for k in keys]
    assert first == [experiment.assign(k).arm.name for k in keys]  # sticky
    share = collections.Counter(first)["control"] / len(keys)
    assert 0.87 <= share <= 0.93, share  # 90 +- 3 %


def test_removing_an_arm_moves_exactly_its_keys_and_a_weight_change_only_to_or_from_that_arm():
    experiment = Experiment.from_dict({"name": "three", "arms": [
        {"name": "a", "model": "llm", "weight": 1}, {"name": "b", "model": "llm_b", "weight": 1},
        {"name": "c", "model": "llm_c", "weight": 1}]})
    keys = [f"k{i}" for i in range(3000)]
    before = {k: experiment.assign(k).arm.name for k in keys}
    without_b = experiment.with_weights({"b": 0})
    after = {k: without_b.assign(k).arm.name for k in keys}
    assert {k for k in keys if before[k] != after[k]} == {k for k in keys if before[k] == "b"}
    assert set(after.values()) == {"a", "c"}
    more_c = experiment.with_weights({"c": 3})
    moved = [(before[k], more_c.assign(k).arm.name) for k in keys if before[k] != more_c.assign(k).arm.name]
    assert moved and all(to == "c" for _, to in moved)


def test_holdout_is_served_by_the_control_outside_the_experiment():
    experiment = Experiment.from_dict(SPEC | {"holdout": 0.2})
    held = [experiment.assign(f"u{i}") for i in range(2000)]
    out = [a for a in held if not a.in_experiment]
    assert 0.17 <= len(out) / 2000 <= 0.23 and all(a.arm.name == "control" for a in out)


@pytest.mark.parametrize("change,message", [
    ({"arms": SPEC["arms"][:1]}, "2 to 16 arms"),
    ({"arms": [SPEC["arms"][0], SPEC["arms"][0]]}, "unique names"),
    ({"sticky_key": "cookie"}, "sticky_key"),
    ({"holdout": 1.0}, "holdout"),
    ({"name": "bad name"}, "name"),
    ({"arms": [{"name": "a", "model": "llm", "weight": -1}, {"name": "b", "model": "llm_b"}]}, "weights"),
    ({"rollout": {"arm": "control"}}, "other than the control"),
    ({"rollout": {"arm": "speculative", "steps": [50, 10]}}, "rising"),
])
def test_a_bad_experiment_file_is_refused(tmp_path, change, message):
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(SPEC | change))
    with pytest.raises(ExperimentError, match=message):
        load_experiment(path)


def _looks(a: np.ndarray, b: np.ndarray, every: int = 50) -> SequentialTest:
    test = SequentialTest()
    for n in range(every, len(a) + 1, every):
        test.look(np.log(a[:n]), np.log(b[:n]))
    return test


def test_identical_arms_are_declared_different_at_most_at_the_nominal_rate_under_continuous_looks():
    """400 A/A experiments on skewed latencies (lognormal with a slow tail), a look every 50
    requests up to 2,000 per arm: the always-valid p-value stays above 0.05 in at least 95 %."""
    rng = np.random.default_rng(0)

    def latencies(n):
        x = rng.lognormal(np.log(0.08), 0.4, n)
        x[rng.random(n) < 0.03] *= 5  # preemptions, queueing
        return x

    false_positives = sum(_looks(latencies(2000), latencies(2000)).p_value < 0.05 for _ in range(400))
    assert false_positives / 400 <= 0.05, false_positives


def test_a_real_difference_is_found_and_its_direction_named():
    rng = np.random.default_rng(1)
    a = rng.lognormal(np.log(0.08), 0.4, 3000)
    b = rng.lognormal(np.log(0.08 * 1.15), 0.4, 3000)  # B 15 % slower
    test = SequentialTest()
    found_at = None
    for n in range(50, 3001, 50):
        result = verdict("ttft", a[:n], b[:n], test)
        if result.verdict != "no difference yet":
            found_at = n
            break
    assert result.verdict == "B worse" and found_at is not None and found_at <= 1000, found_at
    assert 1.05 < result.ratio[0] < 1.3 and result.ratio[1] < result.ratio[0] < result.ratio[2]
    faster = verdict("tokens_per_s", a[:1000], b[:1000], SequentialTest(), lower_is_better=False)
    assert faster.verdict == "B better"  # higher throughput is better


def test_no_difference_yet_says_how_many_more_requests():
    rng = np.random.default_rng(2)
    a, b = rng.lognormal(0, 0.4, 40), rng.lognormal(0, 0.4, 40)
    result = verdict("itl", a, b, SequentialTest())
    assert result.verdict == "no difference yet" and result.more_needed > 0
    assert more_needed(np.log(a), np.log(b)) == result.more_needed
    p50, low, high = result.percentiles["A"][50]
    assert low <= p50 <= high


def _ramp(plan_values: dict | None = None):
    from serving.ab_recorder import ExperimentRecorder
    from serving.rollout import Rollout, RolloutPlan

    experiment = Experiment.from_dict(SPEC)
    plan = RolloutPlan.from_dict({"arm": "speculative", "min_requests": 100} | (plan_values or {}), experiment)
    recorder = ExperimentRecorder(experiment)
    return Rollout(plan, recorder), recorder


def _serve(recorder, arm: str, n: int, rng, ttft_scale: float = 1.0, error_rate: float = 0.0) -> None:
    from serving.ab_recorder import RequestRecord

    for _ in range(n):
        failed = rng.random() < error_rate
        recorder.record(RequestRecord(arm, None if failed else 0.05 * ttft_scale * rng.lognormal(0, 0.3),
                                      None if failed else 0.02 * rng.lognormal(0, 0.2), 0.5, 0 if failed else 16,
                                      "error" if failed else "stop"))


def test_a_healthy_arm_ramps_through_every_step():
    rollout, recorder = _ramp()
    rng = np.random.default_rng(3)
    percents = []
    while not rollout.finished:
        _serve(recorder, "control", 150, rng)
        assert rollout.evaluate().action == "hold"  # the arm has no requests in this step yet
        _serve(recorder, "speculative", 120, rng)
        decision = rollout.evaluate()
        percents.append(decision.percent)
        assert decision.action in ("advance", "done"), decision
    assert percents == [10.0, 50.0, 100.0, 100.0]
    assert rollout.weights() == {"control": 0.0, "speculative": 100.0}


@pytest.mark.parametrize("harm,reason", [(dict(error_rate=0.2), "error rate"), (dict(ttft_scale=2.0), "ttft p99")])
def test_a_broken_guardrail_rolls_back_at_once_with_its_evidence(harm, reason):
    rollout, recorder = _ramp()
    rng = np.random.default_rng(4)
    _serve(recorder, "control", 300, rng)
    _serve(recorder, "speculative", 120, rng)
    assert rollout.evaluate().action == "advance"  # healthy at 1 %
    _serve(recorder, "control", 300, rng)
    _serve(recorder, "speculative", 110, rng, **harm)  # the harm starts in the 10 % step
    decision = rollout.evaluate()
    assert decision.action == "rollback" and reason in decision.reason and decision.percent == 0.0
    assert decision.evidence["requests"]["speculative"] == 110
    assert rollout.weights()["speculative"] == 0.0 and rollout.finished
    assert rollout.evaluate().action == "done"


def test_a_bad_rollout_plan_is_refused():
    from serving.rollout import RolloutPlan

    experiment = Experiment.from_dict(SPEC)
    for values, message in (({"arm": "control"}, "other than the control"),
                            ({"arm": "speculative", "steps": [50, 10]}, "rising"),
                            ({"arm": "speculative", "speed": 2}, "rollout")):
        with pytest.raises(ExperimentError, match=message):
            RolloutPlan.from_dict(values, experiment)


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", '"an experiment"'])
def test_a_file_that_is_not_an_experiment_object_is_refused(tmp_path, text):
    path = tmp_path / "experiment.json"
    path.write_text(text)
    with pytest.raises(ExperimentError, match="experiment.json"):
        load_experiment(path)


RECORDED = Path(__file__).parent / "data" / "ab_recorded_samples.json"


def test_a_a_on_recorded_latencies_stays_within_the_nominal_rate():
    """20 A/A experiments per metric on latencies recorded by the gateway in a real experiment
    (perf/ab_experiment.py, its control arm): each draws two arms of 600 requests from the same
    recorded requests, looks every 20 requests, and is a false positive if the always-valid
    p-value ever falls under 0.05. At most the nominal 5 % may be."""
    recorded = json.loads(RECORDED.read_text())
    rng = np.random.default_rng(3)
    false_positives = naive_false_positives = experiments = 0
    for metric in ("ttft", "itl", "e2e"):
        values = np.array(recorded[metric]["off"])
        assert len(values) >= 100 and bool((values > 0).all())
        for _ in range(20):
            a, b = rng.choice(values, 600), rng.choice(values, 600)
            false_positives += _looks(a, b, every=20).p_value < 0.05
            naive_false_positives += any(_z_test_p(np.log(a[:n]), np.log(b[:n])) < 0.05 for n in range(20, 601, 20))
            experiments += 1
    assert false_positives / experiments <= 0.05, false_positives
    # the same looks with a fixed-sample test would cry wolf far more often: the data can tell
    assert naive_false_positives / experiments > 0.15, naive_false_positives


def _z_test_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided p-value of a fixed-sample z-test of equal means (valid for one look only)."""
    z = (a.mean() - b.mean()) / math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    return math.erfc(abs(z) / math.sqrt(2))
