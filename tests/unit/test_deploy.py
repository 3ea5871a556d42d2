"""The Kubernetes manifests validate against the Kubernetes API schemas (kubernetes-validate, no
cluster needed), and the Grafana dashboard is well formed."""
from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES_VERSION = "1.30"
CORE_KINDS = ("Deployment", "Service", "HorizontalPodAutoscaler")


def _documents():
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            yield path.name, document


@pytest.mark.parametrize("name,document", list(_documents()), ids=lambda v: v if isinstance(v, str) else "")
def test_manifests_validate(name, document):
    if document["kind"] in CORE_KINDS:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    else:  # the Prometheus Operator's PodMonitor: a CRD, not in the API's schemas
        assert document["apiVersion"] == "monitoring.coreos.com/v1" and document["kind"] == "PodMonitor"
        assert document["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_the_manifests_agree():
    documents = {d["kind"]: d for _, d in _documents()}
    pod = documents["Deployment"]["spec"]["template"]
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in documents["Service"]["spec"]["ports"]} <= ports
    assert documents["Service"]["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert documents["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == documents["Deployment"]["metadata"]["name"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8002"


def test_the_dashboard_is_well_formed():
    dashboard = json.loads((DEPLOY / "grafana" / "specserve.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(t["expr"] for t in panel["targets"])
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys()
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "gpu_hour_price"}
