"""Every metric the Grafana dashboard (deploy/grafana/specserve.json) queries, and every label it
groups by, is on the running server's /metrics."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.server
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "specserve.json"


def test_the_dashboards_metrics_exist(server):
    exposed = urllib.request.urlopen(server.handle.metrics_url, timeout=10).read().decode()
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    queried = {name for e in exprs for name in re.findall(r"\bspecserve_\w+", e)}
    assert len(queried) >= 12
    for name in sorted(queried):
        assert re.search(rf"^{name}[{{ ]", exposed, re.M), f"{name} is not on /metrics"
    labels = {label for e in exprs for group in re.findall(r"by \(([^)]*)\)", e) for label in group.split(", ")}
    for label in labels - {"pod", "le"}:  # pod comes from Kubernetes, le from the histograms
        assert f'{label}="' in exposed, f"no metric carries the label {label}"
