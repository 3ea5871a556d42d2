"""A/B experiments: sticky weighted assignment (serving/experiments/experiment.py) and the experiment file
(its arms, metrics and rollout plan). The verdict: test_ab_verdict.py and test_ab_simulation.py;
rollouts: test_rollout.py."""
from __future__ import annotations

import collections
import json

import pytest

from serving.experiments.experiment import Experiment, ExperimentError
from serving.experiments.rollout import load_experiment

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
    ({"rollout": {"arm": "speculative", "max_ttft_p99_ratio": 1.2}}, "rollout"),
    ({"rollout": {"arm": "speculative", "holdout": 0}}, "holdout"),
    ({"metrics": {"success": ["ttft"], "guardrails": {"errors": -1}}}, "margin"),
    ({"metrics": {"success": ["throughput"]}}, "throughput"),
])
def test_a_bad_experiment_file_is_refused(tmp_path, change, message):
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(SPEC | change))
    with pytest.raises(ExperimentError, match=message):
        load_experiment(path)


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", '"an experiment"'])
def test_a_file_that_is_not_an_experiment_object_is_refused(tmp_path, text):
    path = tmp_path / "experiment.json"
    path.write_text(text)
    with pytest.raises(ExperimentError, match="experiment.json"):
        load_experiment(path)


def test_an_experiment_file_names_its_metrics_and_rollout(tmp_path):
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(SPEC | {"metrics": {"success": ["itl"], "guardrails": {"ttft": 1.05, "errors": 0.005}},
                                       "rollout": {"arm": "speculative", "steps": [5, 50, 100], "holdout": 10}}))
    experiment, config, plan = load_experiment(path)
    assert [a.name for a in experiment.arms] == ["control", "speculative"]
    assert config.tested == ("itl", "ttft", "errors") and config.margin("ttft") == pytest.approx(0.04879, abs=1e-5)
    assert plan.steps == (5, 50, 100) and plan.holdout == 10 and plan.min_requests == 200


def test_a_bad_rollout_plan_is_refused():
    from serving.experiments.rollout import RolloutPlan

    experiment = Experiment.from_dict(SPEC)
    for values, message in (({"arm": "control"}, "other than the control"),
                            ({"arm": "speculative", "steps": [50, 10]}, "rising"),
                            ({"arm": "speculative", "speed": 2}, "rollout")):
        with pytest.raises(ExperimentError, match=message):
            RolloutPlan.from_dict(values, experiment)
