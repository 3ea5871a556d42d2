"""The experiment's request log (serving/experiments/request_log.py): lines as documented, rotation, reading back
in order, and `specserve-ab replay` over a log giving the verdict the gateway would have."""
from __future__ import annotations

import json
import math

import numpy as np

from client import ab_report
from perf.ab_simulation import ARMS, Scenario, simulate
from serving.experiments.request_log import LoggedRequest, RequestColumns, RequestLog, hash_user, log_files, read_log
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
