"""The OpenAI gateway as an A/B gateway over two real arms with `llm`'s interface (`llm` and
`llm_bls`): sticky assignment by the `user` field, per-arm measurements on /metrics, the verdict on
/v1/experiment, and weights changed at run time only with the admin key, without a failed request."""
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
    with openai_server(server, "--experiment", str(experiment), env={"SPECSERVE_ADMIN_KEY": ADMIN_KEY},
                       secret=ADMIN_KEY) as base:
        arms = {f"user-{i}": _complete(base, f"user-{i}") for i in range(24)}
        assert set(arms.values()) == {"control", "bls"}
        assert all(_complete(base, user) == arm for user, arm in list(arms.items())[:6])  # sticky

        report = json.loads(urllib.request.urlopen(f"{base}/v1/experiment", timeout=30).read())
        served = collections.Counter(arms.values()) + collections.Counter(list(arms.values())[:6])
        assert report["requests"] == {arm: {"length": served[arm]} for arm in ("control", "bls")}  # 4 tokens each
        ttft = report["versus_control"]["bls"]["ttft"]
        assert ttft["verdict"] in ("no difference yet", "B better", "B worse")
        assert ttft["n"] == [served["control"], served["bls"]]
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
        assert f'specserve_ab_ttft_seconds_count{{experiment="llm-vs-bls",arm="bls"}} {ttft["n"][1]}' in metrics
        assert 'specserve_ab_requests_total{experiment="llm-vs-bls",arm="control",finish_reason="length"}' in metrics
        samples = json.loads(urllib.request.urlopen(f"{base}/v1/experiment/samples?metric=ttft", timeout=30).read())
        assert [len(samples["control"]), len(samples["bls"])] == ttft["n"]
        assert ab_report.main(["report", "--url", base, "--plot", str(tmp_path / "ab.png")]) == 0
        printed = capsys.readouterr().out
        assert "experiment llm-vs-bls" in printed and re.search(r"bls \|\s+ttft \|", printed)
        assert (tmp_path / "ab.png").stat().st_size > 10_000

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


def test_a_rollout_rolls_back_when_the_arm_fails(server, tmp_path):
    """The arm's requests fail (the server's fault hook: a request with FAULT_SEED raises in a
    step); the rollout, judged every 0.3 s, sets the arm's weight to 0 and says why."""
    from serving.experiment import Experiment
    from tests.server.conftest import FAULT_SEED

    values = {"name": "guarded", "sticky_key": "user", "arms": [
        {"name": "control", "model": "llm", "weight": 1}, {"name": "bls", "model": "llm_bls", "weight": 1}],
        "rollout": {"arm": "bls", "steps": [50, 100], "min_requests": 4}}
    (tmp_path / "experiment.json").write_text(json.dumps(values))
    ramp = Experiment.from_dict(values).with_weights({"control": 50, "bls": 50})  # the first step's split
    with openai_server(server, "--experiment", str(tmp_path / "experiment.json"), "--rollout-interval", "0.3") as base:
        users = [f"user-{i}" for i in range(16)]
        served = []
        for user in users:  # the arm's users send the fault seed; once rolled back, control serves them
            failing = ramp.assign(user).arm.name == "bls"
            status, headers, _ = _post(base, "/v1/completions", {
                "prompt": "def f(x):", "max_tokens": 6, "user": user, "seed": FAULT_SEED if failing else 1})
            served.append(headers["x-specserve-arm"])
            assert status == (500 if failing else 200) and served[-1] in ("control", "bls")
            assert served[-1] == "control" or failing
        assert served.count("bls") >= 3
        deadline = time.monotonic() + 30
        while True:
            report = json.loads(urllib.request.urlopen(f"{base}/v1/experiment", timeout=30).read())
            if report["rollout"]["finished"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        [decision] = report["rollout"]["decisions"]
        assert decision["action"] == "rollback" and "error rate" in decision["reason"]
        assert report["weights"] == {"control": 100.0, "bls": 0.0}
        assert {_complete(base, user) for user in users} == {"control"}


def _load(base: str, first: int, count: int, users: int = 16) -> list[str]:
    """`count` completions from `users` concurrent clients, request i as user `first + i`."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(users) as pool:
        return list(pool.map(lambda i: _complete(base, f"load-{first + i}", max_tokens=16), range(count)))


def _verdict(base: str, arm: str, metric: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{base}/v1/experiment", timeout=30).read())["versus_control"][arm][metric]


@pytest.fixture(scope="module")
def two_configs(tmp_path_factory):
    """`llm` and `llm_slow`: the same model, the second's engine running at most 2 requests at once."""
    from tests.server.conftest import start_test_server

    server = start_test_server(tmp_path_factory.mktemp("ab"), "", variants={"slow": {"max_num_seqs": "2"}})
    yield server
    server.handle.stop()


def test_a_worse_configuration_is_found_worse_and_identical_arms_are_not(two_configs, tmp_path):
    """16 concurrent users; arm B's engine batches 2 requests at most: its TTFT is called worse
    within 800 requests (the number is printed). Three A/A experiments (both arms `llm`, 160
    requests each, a look every 40) find no difference."""
    experiment = tmp_path / "experiment.json"
    experiment.write_text(json.dumps({"name": "batching", "arms": [
        {"name": "control", "model": "llm"}, {"name": "slow", "model": "llm_slow"}]}))
    with openai_server(two_configs, "--experiment", str(experiment)) as base:
        served = 0
        while served < 800:
            _load(base, served, 40)
            served += 40
            if _verdict(base, "slow", "ttft")["verdict"] != "no difference yet":
                break
        found = _verdict(base, "slow", "ttft")
        print(f"\nmax_num_seqs 2 vs 64: {found['verdict']} after {served} requests, TTFT ratio {found['ratio']}")
        assert found["verdict"] == "B worse"
    for run in range(3):
        experiment.write_text(json.dumps({"name": f"a-a-{run}", "arms": [
            {"name": "control", "model": "llm"}, {"name": "same", "model": "llm"}]}))
        with openai_server(two_configs, "--experiment", str(experiment)) as base:
            for look in range(4):
                _load(base, 1000 * (run + 1) + 40 * look, 40)
                for metric in ("ttft", "itl", "e2e"):
                    assert _verdict(base, "same", metric)["verdict"] in ("no difference yet", "no data yet")
