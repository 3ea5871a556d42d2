"""The experiment's request log (serving/experiments/request_log.py): lines as documented, rotation, reading back
in order, and `specserve-ab replay` over a log giving the verdict the gateway would have."""
from __future__ import annotations

import json
import math

import numpy as np

from client import ab_report
from perf.ab_simulation import ARMS, Scenario, simulate
from serving.experiments.request_log import (
    LoggedRequest,
    RequestColumns,
    RequestLog,
    hash_user,
    log_files,
    read_log,
    read_logs,
)
from serving.experiments.verdict import Verdict


def _logged(columns: RequestColumns) -> list[LoggedRequest]:
    def value(x):
        return None if math.isnan(x) else float(x)

    return [LoggedRequest(1e9 + i, columns.arm[i], hash_user("x", str(columns.user[i])), columns.status[i],
                          int(columns.period[i]), value(columns.ttft_s[i]), value(columns.itl_s[i]),
                          value(columns.e2e_s[i]), 32)
            for i in range(len(columns))]


def test_a_line_holds_the_documented_fields_and_no_sticky_key():
    line = json.loads(LoggedRequest(12.5, "b", hash_user("exp", "alice@example.com"), "ok", 2, 0.1, 0.02, 1.3, 64).line())
    assert line == {"time": 12.5, "arm": "b", "user": hash_user("exp", "alice@example.com"), "status": "ok",
                    "period": 2, "ttft_s": 0.1, "itl_s": 0.02, "e2e_s": 1.3, "output_tokens": 64}
    assert "alice" not in line["user"] and hash_user("exp", "alice@example.com") != hash_user("other", "alice@example.com")
    failed = json.loads(LoggedRequest(1.0, "b", None, "error", 0).line())
    assert failed == {"time": 1.0, "arm": "b", "status": "error", "period": 0, "output_tokens": 0}


def test_the_log_rotates_and_reads_back_in_arrival_order(tmp_path):
    path = tmp_path / "requests.jsonl"
    log = RequestLog(path, max_bytes=2000, backups=3)
    for i in range(100):
        log.append(LoggedRequest(float(i), "a", f"u{i % 7}", "ok", 0, 0.1, None, 0.5, 3))
    with open(path, "a") as torn:
        torn.write('{"time": 100.0, "arm": "a"')  # a crash mid-line
    log.close()
    files = log_files(path)
    assert [f.name for f in files] == ["requests.jsonl.3", "requests.jsonl.2", "requests.jsonl.1", "requests.jsonl"]
    assert all(f.stat().st_size < 2200 for f in files)
    times = [r["time"] for chunk in read_log(path, chunk=7) for r in chunk]
    assert times == sorted(times) and times[-1] == 99.0 and len(times) < 100  # the oldest were rotated away


def test_replay_runs_the_gateways_verdict_over_a_log(tmp_path, capsys):
    columns = simulate(Scenario("slower", ((1500, (80, 20)), (1500, (50, 50))), users=300, error_rate=0.01,
                                slower=1.3), 11)
    path = tmp_path / "requests.jsonl"
    log = RequestLog(path)
    for request in _logged(columns):
        log.append(request)
    log.close()
    assert ab_report.main(["replay", str(path), "--control", ARMS[0], "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    in_memory = Verdict(list(ARMS))  # what the gateway's verdict holds after the same requests
    for chunk in read_log(path):
        in_memory.add(RequestColumns.from_records(chunk))
    assert replayed == json.loads(json.dumps(in_memory.report()))
    arm = replayed["arms"][ARMS[1]]
    assert arm["decision"] == "worse" and arm["metrics"]["ttft"]["estimate"] > 1.1
    assert {"estimate", "interval", "p_value", "decided_at"} <= arm["metrics"]["ttft"].keys()
    assert replayed["requests"] == len(columns)

    assert ab_report.main(["replay", str(path), "--control", ARMS[0]]) == 0
    table = capsys.readouterr().out
    assert f"{ARMS[1]}: worse (after request {arm['decided_at']})" in table


def test_columns_from_records_fill_what_is_missing():
    columns = RequestColumns.from_records([{"arm": "a", "status": "error"},
                                           {"arm": "b", "status": "ok", "user": "u", "ttft_s": 0.2, "period": 3}])
    assert columns.period.tolist() == [0, 3] and columns.user.tolist() == [None, "u"]
    assert np.isnan(columns.ttft_s[0]) and columns.ttft_s[1] == 0.2 and np.isnan(columns.e2e_s).all()


def _replica_logs(tmp_path, seed: int, requests: int = 2000, slower: float = 1.0) -> list[str]:
    """Two gateway replicas' logs of one experiment: the same users, the first replica splitting
    50:50, the second 90:10 and 1.5x slower (another kind of machine); their requests interleaved."""
    paths = []
    for replica, (weights, speed) in enumerate((((50, 50), 1.0), ((90, 10), 1.5))):
        columns = simulate(Scenario("replica", ((requests, weights),), users=300, slower=slower), 100 * seed + replica)
        for name in ("ttft_s", "itl_s", "e2e_s"):
            setattr(columns, name, getattr(columns, name) * speed)
        paths.append(str(tmp_path / f"replica-{seed}-{replica}.jsonl"))
        log = RequestLog(paths[-1])
        for i, request in enumerate(_logged(columns)):
            request.time = 1e9 + 2 * i + replica
            log.append(request)
        log.close()
    return paths


def test_replicas_logs_replay_as_one_experiment_stratified_by_replica(tmp_path, capsys):
    """Each replica's periods are strata of their own and a user is one unit across replicas. With
    replicas that split differently and run at different speeds, identical arms are called the
    same (a plain merge of the logs is fooled: the slower replica sends most of its traffic to the
    control); an arm 30 % slower is found worse."""
    paths = _replica_logs(tmp_path, 0)
    assert ab_report.main(["replay", *paths, "--control", ARMS[0], "--json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert merged["requests"] == 4000 and merged["arms"][ARMS[1]]["decision"] == "no difference"
    assert sorted(merged["tail_thresholds"]) == ["itl_tail:0", "itl_tail:1", "ttft_tail:0", "ttft_tail:1"]
    users = {r["user"] for path in paths for chunk in read_log(path) for r in chunk}
    assert sum(merged["users"].values()) >= len(users)  # a user on both arms counts on each
    plain = Verdict(list(ARMS))
    for chunk in read_logs(paths):
        plain.add(RequestColumns.from_records([r | {"period": 0} for r in chunk]))
    assert plain.states[(ARMS[1], "ttft")].direction == "better"  # what stratifying by replica prevents
    # identical arms over 20 pairs of replicas, called different on any metric: a count above 6 has
    # probability under 1e-4 at alpha 0.05
    called = [{m["direction"] for m in ab_report.replay(_replica_logs(tmp_path, seed), ARMS[0])["arms"][ARMS[1]]
               ["metrics"].values()} - {None} for seed in range(1, 21)]
    assert sum(bool(c) for c in called) <= 6, called
    worse = ab_report.replay(_replica_logs(tmp_path, 50, slower=1.3), ARMS[0])
    assert worse["arms"][ARMS[1]]["decision"] == "worse"
    assert ab_report.replay(paths[:1], ARMS[0]) == ab_report.replay(paths[0], ARMS[0])  # one log: as read_log
