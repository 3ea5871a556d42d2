"""Every metric the Grafana dashboard (deploy/grafana/specserve.json) queries, and every label it
groups by, is on the running server's /metrics."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests.server.conftest import openai_server

pytestmark = pytest.mark.server
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "specserve.json"


def _check(exprs: list[str], exposed: str) -> set[str]:
    queried = {name for e in exprs for name in re.findall(r"\bspecserve_\w+", e)}
    for name in sorted(queried):
        assert re.search(rf"^{name}[{{ ]", exposed, re.M), f"{name} is not on /metrics"
    labels = {label for e in exprs for group in re.findall(r"by \(([^)]*)\)", e) for label in group.split(", ")}
    for label in labels - {"pod", "le"}:  # pod comes from Kubernetes, le from the histograms
        assert f'{label}="' in exposed, f"no metric carries the label {label}"
    return queried


def _exprs(gateway: bool) -> list[str]:
    """The dashboard's queries of the server's metrics, or of the OpenAI gateway's (specserve_ab_*)."""
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    return [e for e in exprs if ("specserve_ab_" in e) == gateway]


def test_the_dashboards_metrics_exist(server):
    exposed = urllib.request.urlopen(server.handle.metrics_url, timeout=10).read().decode()
    assert len(_check(_exprs(gateway=False), exposed)) >= 12


def test_the_dashboards_experiment_panels_read_the_gateways_metrics(server, tmp_path):
    experiment = tmp_path / "experiment.json"
    experiment.write_text(json.dumps({"name": "dash", "arms": [{"name": "a", "model": "llm"},
                                                               {"name": "b", "model": "llm_bls"}]}))
    with openai_server(server, "--experiment", str(experiment)) as base:
        request = urllib.request.Request(f"{base}/v1/completions", json.dumps(
            {"prompt": "x", "max_tokens": 3, "user": "u"}).encode(), {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=60).read()
        exposed = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    assert len(_check(_exprs(gateway=True), exposed)) == 4
