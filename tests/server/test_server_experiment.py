"""The OpenAI gateway as an A/B gateway over two real arms with `llm`'s interface (`llm` and
`llm_bls`): sticky assignment by the `user` field, per-arm measurements on /metrics and in the
request log, the verdict on /v1/experiment (and the same from `specserve-ab replay` of the log),
weights changed at run time only with the admin key, and guarded rollouts that roll back an arm
that fails or is slow, and stay rolled back across a restart."""
from __future__ import annotations

import collections
import json
import re
import time
import urllib.error
import urllib.request

import pytest

from client import ab_report
from tests.server.conftest import openai_server

pytestmark = pytest.mark.server
ADMIN_KEY = "experiment-admin-key-for-tests"


def _post(base: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    request = urllib.request.Request(f"{base}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"} | (headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _complete(base: str, user: str, max_tokens: int = 4) -> str:
    status, headers, body = _post(base, "/v1/completions", {"prompt": "def f(x):", "max_tokens": max_tokens,
                                                            "temperature": 0, "user": user})
    assert status == 200 and body["choices"][0]["text"]
    return headers["x-specserve-arm"]


def test_an_experiment_splits_measures_and_moves_traffic(server, tmp_path, capsys):
    experiment = tmp_path / "experiment.json"
    experiment.write_text(json.dumps({"name": "llm-vs-bls", "sticky_key": "user", "arms": [
        {"name": "control", "model": "llm", "weight": 50}, {"name": "bls", "model": "llm_bls", "weight": 50}]}))
    log = tmp_path / "requests.jsonl"
    with openai_server(server, "--experiment", str(experiment), "--experiment-log", str(log),
                       env={"SPECSERVE_ADMIN_KEY": ADMIN_KEY}, secret=ADMIN_KEY) as base:
        arms = {f"user-{i}": _complete(base, f"user-{i}") for i in range(24)}
        assert set(arms.values()) == {"control", "bls"}
        assert all(_complete(base, user) == arm for user, arm in list(arms.items())[:6])  # sticky

        report = json.loads(urllib.request.urlopen(f"{base}/v1/experiment", timeout=30).read())
        served = collections.Counter(arms.values()) + collections.Counter(list(arms.values())[:6])
        assert report["statuses"] == {arm: {"ok": served[arm]} for arm in ("control", "bls")}
        assert report["users"] == {arm: list(arms.values()).count(arm) for arm in ("control", "bls")}
        ttft = report["arms"]["bls"]["metrics"]["ttft"]
        assert report["arms"]["bls"]["decision"] == "no difference" and ttft["values"] == served["bls"] + served["control"]
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
        assert f'specserve_ab_ttft_seconds_count{{experiment="llm-vs-bls",arm="bls"}} {served["bls"]}' in metrics
        assert 'specserve_ab_requests_total{experiment="llm-vs-bls",arm="control",finish_reason="length"}' in metrics
        ecdf = json.loads(urllib.request.urlopen(f"{base}/v1/experiment/ecdf?metric=ttft", timeout=30).read())
        assert {arm: sum(c) for arm, c in ecdf["counts"].items()} == {arm: served[arm] for arm in ("control", "bls")}
        assert ab_report.main(["report", "--url", base, "--plot", str(tmp_path / "ab.png")]) == 0
        printed = capsys.readouterr().out
        assert "experiment llm-vs-bls" in printed and re.search(r"bls \|\s+ttft \|", printed)
        assert (tmp_path / "ab.png").stat().st_size > 10_000
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(lines) == sum(served.values()) and {line["status"] for line in lines} == {"ok"}
        assert "user-0" not in log.read_text()  # the sticky key is hashed
        assert ab_report.main(["replay", str(log), "--control", "control", "--json"]) == 0
        replayed = json.loads(capsys.readouterr().out)
        assert replayed["statuses"] == report["statuses"] and replayed["users"] == report["users"]

        status, _, body = _post(base, "/v1/experiment/weights", {"weights": {"bls": 0}})
        assert status == 403 and body["error"]["type"] == "permission_error"
        status, _, body = _post(base, "/v1/experiment/weights", {"weights": {"bls": 0}}, {"specserve-admin-key": "no"})
        assert status == 403
        status, _, body = _post(base, "/v1/experiment/weights", {"weights": {"nope": 1}},
                                {"specserve-admin-key": ADMIN_KEY})
        assert status == 400 and body["error"]["param"] == "weights"
        status, _, body = _post(base, "/v1/experiment/weights", {"weights": {"bls": 0}},
                                {"specserve-admin-key": ADMIN_KEY})
        assert status == 200 and body == {"weights": {"control": 50, "bls": 0}}
        assert {_complete(base, user) for user in arms} == {"control"}  # the removed arm's users moved
        assert json.loads(urllib.request.urlopen(f"{base}/v1/experiment", timeout=30).read())["period"] == 1


def _rollout_report(base: str, deadline_s: float = 30) -> dict:
    """/v1/experiment once the rollout has ended (or the deadline passed)."""
    deadline = time.monotonic() + deadline_s
    while True:
        report = json.loads(urllib.request.urlopen(f"{base}/v1/experiment", timeout=30).read())
        if report["rollout"]["finished"] or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def test_a_rollout_rolls_back_when_the_arm_fails_and_stays_rolled_back_after_a_restart(server, tmp_path):
    """The arm's requests fail (the server's fault hook: a request with FAULT_SEED raises in a
    step); the rollout, judged every 0.3 s, sets the arm's weight to 0 and says why. A bad request
    (a 4xx) is the client's, not the arm's. A gateway restarted on the same log resumes the
    rolled-back experiment: every user on the control."""
    from serving.experiments.experiment import Experiment
    from tests.server.conftest import FAULT_SEED

    values = {"name": "guarded", "sticky_key": "user", "arms": [
        {"name": "control", "model": "llm", "weight": 1}, {"name": "bls", "model": "llm_bls", "weight": 1}],
        "rollout": {"arm": "bls", "steps": [50, 100], "min_requests": 4}}
    (tmp_path / "experiment.json").write_text(json.dumps(values))
    log = tmp_path / "requests.jsonl"
    ramp = Experiment.from_dict(values).with_weights({"control": 50, "bls": 50})  # the first step's split
    users = [f"user-{i}" for i in range(60)]
    args = ("--experiment", str(tmp_path / "experiment.json"), "--experiment-log", str(log), "--rollout-interval", "0.3")
    with openai_server(server, *args) as base:
        status, _, _ = _post(base, "/v1/completions", {"prompt": "def f(x):", "max_tokens": -5, "user": "bad"})
        assert status == 400
        served = []
        for user in users:  # the arm's users send the fault seed until the arm is rolled back
            weights = json.loads(urllib.request.urlopen(f"{base}/v1/experiment", timeout=30).read())["weights"]
            failing = weights["bls"] > 0 and ramp.assign(user).arm.name == "bls"
            status, headers, _ = _post(base, "/v1/completions", {
                "prompt": "def f(x):", "max_tokens": 6, "user": user, "seed": FAULT_SEED if failing else 1})
            served.append(headers["x-specserve-arm"])
            if failing and served[-1] == "control":
                # rolled back between reading the weights and this request, whose fault seed then
                # failed it on the control's engine
                weights = json.loads(urllib.request.urlopen(f"{base}/v1/experiment", timeout=30).read())["weights"]
                assert status == 500 and weights["bls"] == 0
            else:
                assert (status, served[-1]) == ((500, "bls") if failing else (200, "control"))
        assert served.count("bls") >= 20
        report = _rollout_report(base)
        [decision] = report["rollout"]["decisions"]
        assert decision["action"] == "rollback" and "errors" in decision["reason"], decision
        assert report["weights"] == {"control": 100.0, "bls": 0.0}
        assert report["arms"]["bls"]["metrics"]["errors"]["direction"] == "worse"
        assert {_complete(base, user) for user in users[:10]} == {"control"}
        statuses = report["statuses"]
    assert (tmp_path / "requests.jsonl.rollout.json").exists()
    with openai_server(server, *args) as base:
        again = json.loads(urllib.request.urlopen(f"{base}/v1/experiment", timeout=30).read())
        assert again["rollout"]["outcome"] == "rolled back" and again["weights"] == {"control": 100.0, "bls": 0.0}
        assert again["statuses"]["bls"] == statuses["bls"]  # the verdict read back from the log
        assert {_complete(base, user) for user in users[::3]} == {"control"}


def _load(base: str, first: int, count: int, users: int = 16) -> list[str]:
    """`count` completions from `users` concurrent clients, request i as user `first + i`."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(users) as pool:
        return list(pool.map(lambda i: _complete(base, f"load-{first + i}", max_tokens=16), range(count)))


def _verdict(base: str, arm: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{base}/v1/experiment", timeout=30).read())["arms"][arm]


@pytest.fixture(scope="module")
def two_configs(tmp_path_factory):
    """`llm` and `llm_slow`: the same model, the second's engine running one request at a time."""
    from tests.server.conftest import start_test_server

    server = start_test_server(tmp_path_factory.mktemp("ab"), "", variants={"slow": {"max_num_seqs": "1"}})
    yield server
    server.handle.stop()


def test_a_worse_configuration_is_found_worse_and_identical_arms_are_not(two_configs, tmp_path):
    """16 concurrent users; arm B's engine runs one request at a time: its TTFT is called worse
    within 800 requests (the number is printed). An A/A experiment (both arms `llm`, 160 requests,
    a look after every request) finds no difference: it runs at alpha 1e-5, so this part fails by
    chance less than once in 10^5 runs (the false-positive bound is alpha; tests/unit/test_ab_simulation.py
    checks the rate itself over 200 seeded runs per scenario)."""
    experiment = tmp_path / "experiment.json"
    experiment.write_text(json.dumps({"name": "batching", "arms": [
        {"name": "control", "model": "llm"}, {"name": "slow", "model": "llm_slow"}]}))
    with openai_server(two_configs, "--experiment", str(experiment)) as base:
        served = 0
        while served < 800:
            _load(base, served, 40)
            served += 40
            if _verdict(base, "slow")["decision"] != "no difference":
                break
        found = _verdict(base, "slow")
        print(f"\nmax_num_seqs 1 vs 64: {found['decision']} after {served} requests, TTFT ratio "
              f"{found['metrics']['ttft']['estimate']:.2f}")
        assert found["decision"] == "worse" and found["metrics"]["ttft"]["direction"] == "worse"
    experiment.write_text(json.dumps({"name": "a-a", "metrics": {"alpha": 1e-5}, "arms": [
        {"name": "control", "model": "llm"}, {"name": "same", "model": "llm"}]}))
    with openai_server(two_configs, "--experiment", str(experiment)) as base:
        for look in range(4):
            _load(base, 1000 + 40 * look, 40)
            assert _verdict(base, "same")["decision"] == "no difference"


def test_a_rollout_rolls_back_an_arm_that_is_slow_under_load(two_configs, tmp_path):
    """The latency guardrail through the real server: a rollout of the one-request-at-a-time arm
    under 16 concurrent users is rolled back on its TTFT at its first step."""
    experiment = tmp_path / "experiment.json"
    experiment.write_text(json.dumps({"name": "slow-rollout", "arms": [
        {"name": "control", "model": "llm"}, {"name": "slow", "model": "llm_slow"}],
        "rollout": {"arm": "slow", "steps": [50, 100], "min_requests": 400}}))
    with openai_server(two_configs, "--experiment", str(experiment), "--rollout-interval", "0.5") as base:
        served = 0
        while served < 800:
            _load(base, 5000 + served, 40)
            served += 40
            report = json.loads(urllib.request.urlopen(f"{base}/v1/experiment", timeout=30).read())
            if report["rollout"]["finished"]:
                break
        report = _rollout_report(base, 5)
        [decision] = report["rollout"]["decisions"]
        assert decision["action"] == "rollback" and {"ttft", "e2e"} & set(decision["evidence"]["worse"]), decision
        assert report["weights"] == {"control": 100.0, "slow": 0.0}
