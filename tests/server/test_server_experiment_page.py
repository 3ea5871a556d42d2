"""The A/B gateway's reads and its live page, over two real arms (`llm` and `llm_bls`): a flood of
reads (the verdict, ECDFs, /metrics, the page) is held to its share of the concurrency bound while
generation beside it is answered in full and unchanged, and the page (serving/gateway/experiment_page.py),
opened in a real headless Chromium, shows what GET /v1/experiment says and follows it as requests
come in."""
from __future__ import annotations

import collections
import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.server.conftest import openai_server
from tests.server.test_server_experiment import _complete, _post

pytestmark = pytest.mark.server
ARMS = [{"name": "control", "model": "llm", "weight": 50}, {"name": "bls", "model": "llm_bls", "weight": 50}]
READS = ("/v1/experiment", "/v1/experiment/ecdf?metric=ttft", "/metrics", "/experiment")
# where to keep the page's screenshot as well (docs/images/experiment-page.png is made so)
SCREENSHOT_ENV = "SPECSERVE_PAGE_SCREENSHOT"


def _get(base: str, path: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{base}{path}", timeout=30).read())


def _text(base: str, user: str, prompt: str) -> str:
    status, _, body = _post(base, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                      "user": user})
    assert status == 200, body
    return body["choices"][0]["text"]


def _experiment(tmp_path: Path, **extra) -> str:
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps({"name": "page", "sticky_key": "user", "arms": ARMS} | extra))
    return str(path)


def test_a_flood_of_reads_takes_only_its_share_and_generation_is_unharmed(server, tmp_path):
    prompts = [(f"user-{i}", f"def f{i}(x):") for i in range(8)]
    args = ("--experiment", _experiment(tmp_path), "--experiment-page", "--max-concurrent-requests", "24",
            "--max-concurrent-reads", "2")
    with openai_server(server, *args) as base:
        alone = {user: _text(base, user, prompt) for user, prompt in prompts}
        stop, answers, refusals = threading.Event(), collections.Counter(), set()

        def read(path: str) -> None:
            while not stop.is_set():
                try:
                    urllib.request.urlopen(f"{base}{path}", timeout=30).read()
                    answers[200] += 1
                except urllib.error.HTTPError as e:
                    answers[e.code] += 1
                    refusals.add(json.loads(e.read())["error"]["message"])

        readers = [threading.Thread(target=read, args=(path,)) for path in READS * 4]
        for reader in readers:
            reader.start()
        time.sleep(0.5)
        try:
            with ThreadPoolExecutor(len(prompts)) as pool:
                flooded = dict(zip(alone, pool.map(lambda p: _text(base, *p), prompts)))
        finally:
            stop.set()
            for reader in readers:
                reader.join()
        report = _get(base, "/v1/experiment")
    assert flooded == alone  # every request answered (a 200), the same greedy text as without the flood
    assert answers[200] > 0 and answers[429] > 0 and set(answers) == {200, 429}, answers
    assert refusals == {"2 reads are in flight, the most this server takes; retry later"}
    assert sum(sum(s.values()) for s in report["statuses"].values()) == 2 * len(prompts)


# every value the page shows with data-field, read from the DOM as the browser rendered it
READ_PAGE = """
const fields = root => Object.fromEntries([...root.querySelectorAll("[data-field]")].map(
  node => [node.dataset.field, node.dataset.value === undefined ? node.textContent : node.dataset.value]));
const shown = root => Object.fromEntries([...root.querySelectorAll("[data-field]")].map(
  node => [node.dataset.field, node.textContent]));
const page = {polls: document.body.dataset.polls, top: {}, arms: {}, metrics: {}, shown: {}, ecdf: {}};
for (const id of ["experiment", "control", "requests", "period"])
  page.top[id] = document.getElementById(id).dataset.value;
document.querySelectorAll("#arms tr[data-arm]").forEach(row => page.arms[row.dataset.arm] = fields(row));
document.querySelectorAll("section.verdict").forEach(section => {
  page.metrics[section.dataset.arm] = {};
  page.shown[section.dataset.arm] = {};
  section.querySelectorAll("tr[data-metric]").forEach(row => {
    page.metrics[section.dataset.arm][row.dataset.metric] = fields(row);
    page.shown[section.dataset.arm][row.dataset.metric] = shown(row);
  });
});
const rollout = document.getElementById("rollout");
page.rollout = fields(rollout);
page.rollout.decisions = [...rollout.querySelectorAll("li")].map(li => li.dataset.action);
const latest = document.getElementById("rollout-latest");
page.rollout.latest = latest ? latest.dataset.action : null;
for (const metric of ["ttft", "itl"])
  page.ecdf[metric] = Object.fromEntries([...document.querySelectorAll(`#ecdf-${metric} polyline`)].map(
    line => [line.dataset.arm, +line.dataset.total]));
return page;
"""


def _differences(page: dict, report: dict, ecdf: dict) -> list[str]:
    """Where the rendered page and the JSON it was drawn from disagree (empty: nowhere)."""
    value = lambda x: None if x in ("", None) else float(x)  # noqa: E731
    wrong = []
    expect = lambda what, got, want: wrong.append(f"{what}: page {got!r}, JSON {want!r}") if got != want else None  # noqa: E731
    for key in ("experiment", "control", "requests", "period"):
        expect(key, page["top"].get(key), str(report[key]))
    total = sum(report["weights"].values())
    for arm, weight in report["weights"].items():
        row, statuses = page["arms"].get(arm, {}), report["statuses"][arm]
        expect(f"{arm} share", value(row.get("share")), weight / total)
        expect(f"{arm} requests", value(row.get("requests")), sum(statuses.values()))
        expect(f"{arm} users", value(row.get("users")), report["users"][arm])
        for status in ("ok", "error", "client_error", "cancelled"):
            expect(f"{arm} {status}", value(row.get(status)), statuses.get(status, 0))
        for metric in ("ttft", "itl"):
            for q in ("50", "99"):
                expect(f"{arm} {metric} p{q}", value(row.get(f"{metric}_p{q}")), report["quantiles"][arm][metric][q])
        want = report["arms"][arm]["decision"] if arm in report["arms"] else ""
        expect(f"{arm} decision", row.get("decision"), want)
    for arm, verdict in report["arms"].items():
        for name, m in verdict["metrics"].items():
            row = page["metrics"].get(arm, {}).get(name, {})
            expect(f"{arm} {name} estimate", value(row.get("estimate")), m["estimate"])
            interval = None if not row.get("interval") else [float(x) for x in row["interval"].split(",")]
            expect(f"{arm} {name} interval", interval, m["interval"])
            expect(f"{arm} {name} p", value(row.get("p_value")), m["p_value"])
            expect(f"{arm} {name} direction", row.get("direction") or None, m["direction"])
            expect(f"{arm} {name} values", value(row.get("values")), m["values"])
            if m["role"] == "guardrail":
                expect(f"{arm} {name} margin", value(row.get("margin")), m["margin"])
                expect(f"{arm} {name} non-inferior", value(row.get("non_inferior_at")), m["non_inferior_at"])
    rollout = report["rollout"]
    expect("rollout step", value(page["rollout"].get("step")), rollout["step"])
    expect("rollout percent", value(page["rollout"].get("percent")), rollout["percent"])
    expect("rollout moves", page["rollout"]["decisions"], [d["action"] for d in rollout["decisions"]])
    expect("rollout latest", page["rollout"]["latest"], (rollout["latest"] or {}).get("action"))
    expect("ttft ecdf", page["ecdf"]["ttft"], {arm: sum(c) for arm, c in ecdf["counts"].items() if sum(c)})
    return wrong


def _browser(chromium: str, chromedriver: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1100,1000", "--force-device-scale-factor=1", "--hide-scrollbars"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(chromedriver))


def _matching(driver, base: str, deadline_s: float = 60) -> tuple[dict, dict]:
    """The page and the JSON once they agree (the page polls every 2 s; a rollout may move between
    a read of the JSON and the page's next poll, so both are read again until they do)."""
    deadline = time.monotonic() + deadline_s
    while True:
        report, ecdf = _get(base, "/v1/experiment"), _get(base, "/v1/experiment/ecdf?metric=ttft")
        page = driver.execute_script(READ_PAGE)
        wrong = _differences(page, report, ecdf) if page["polls"] else ["no poll yet"]
        if not wrong:
            return page, report
        assert time.monotonic() < deadline, wrong
        time.sleep(0.5)


def test_the_live_page_shows_the_verdict_in_a_real_browser_and_follows_it(server, tmp_path):
    pytest.importorskip("selenium", reason="selenium is not installed: pip install -e '.[dev]'")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        pytest.skip("no Chromium to open the page in: apt-get install chromium chromium-driver (Debian)")
    rollout = {"arm": "bls", "steps": [50, 100], "min_requests": 4}
    args = ("--experiment", _experiment(tmp_path, rollout=rollout), "--experiment-log", str(tmp_path / "ab.jsonl"),
            "--experiment-page", "--rollout-interval", "0.3")
    with openai_server(server, *args) as base:
        for i in range(60):
            _complete(base, f"user-{i}")
        driver = _browser(chromium, chromedriver)
        try:
            driver.get(f"{base}/experiment")
            page, report = _matching(driver, base)
            assert set(page["arms"]) == {"control", "bls"} and report["requests"] == 60
            ttft = report["arms"]["bls"]["metrics"]["ttft"]
            assert page["shown"]["bls"]["ttft"]["estimate"] == f"{ttft['estimate']:.3f}×"
            errors = report["arms"]["bls"]["metrics"]["errors"]
            assert page["shown"]["bls"]["errors"]["estimate"] == f"{100 * errors['estimate']:+.2f} pt"
            # 60 requests are past min_requests, so the rollout has moved (the page shows which way, as
            # _differences checked); which way is the verdict's call on two real arms: llm_bls adds a
            # hop, which a loaded machine may show as a worse TTFT (a rollback)
            assert page["rollout"]["decisions"][:1] in (["advance"], ["rollback"])
            polls = int(page["polls"])

            for i in range(60, 72):  # new users come: the page follows
                _complete(base, f"user-{i}")
            page, report = _matching(driver, base)
            assert report["requests"] == 72 and int(page["polls"]) > polls
            screenshot = tmp_path / "experiment-page.png"
            driver.save_screenshot(str(screenshot))
        finally:
            driver.quit()
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 20_000
    if os.environ.get(SCREENSHOT_ENV):
        from PIL import Image

        Image.open(screenshot).convert("RGB").quantize(64).save(os.environ[SCREENSHOT_ENV], optimize=True)
