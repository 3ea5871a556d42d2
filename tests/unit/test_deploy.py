"""The Kubernetes manifests validate against the Kubernetes API schemas (kubernetes-validate, no
cluster needed), the Deployment, the NetworkPolicy and the Dockerfile are hardened, and the
Grafana dashboard is well formed."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from string import Template

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile"
KUBERNETES_VERSION = "1.30"
CORE_KINDS = ("Deployment", "Service", "HorizontalPodAutoscaler", "NetworkPolicy")
SERVING_PORTS = {"http": 8000, "grpc": 8001, "openai": 9000}  # container port name -> number
METRICS_PORT = 8002
PROMETHEUS_PEER = {  # who may scrape: Prometheus pods in the monitoring namespace
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


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


def _kinds() -> dict[str, dict]:
    return {d["kind"]: d for _, d in _documents()}


def _pod() -> dict:
    return _kinds()["Deployment"]["spec"]["template"]


def _container_security(pod_spec: dict, container: dict) -> dict:
    """The settings a container runs with: the pod's, overridden by the container's own."""
    pod_level = {k: v for k, v in pod_spec.get("securityContext", {}).items() if k != "fsGroup"}
    return pod_level | container.get("securityContext", {})


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")
    ))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def _dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction, args in _dockerfile():
        if instruction == "ENV":
            tokens = shlex.split(args)
            pairs = [t.split("=", 1) for t in tokens] if "=" in tokens[0] else [(tokens[0], " ".join(tokens[1:]))]
            env |= {key: Template(value).safe_substitute(env) for key, value in pairs}
    return env


def _dockerfile_user() -> str:
    users = [args.strip() for instruction, args in _dockerfile() if instruction == "USER"]
    assert users, "the Dockerfile sets no USER: the image runs as root"
    return users[-1]


def test_the_pod_runs_as_a_non_root_user():
    pod_spec = _pod()["spec"]
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    for container in pod_spec["containers"]:
        security = _container_security(pod_spec, container)
        assert security["runAsNonRoot"] is True, container["name"]
        for key in ("runAsUser", "runAsGroup"):
            assert isinstance(security[key], int) and security[key] > 0, (container["name"], key)
    assert isinstance(pod_spec["securityContext"]["fsGroup"], int) and pod_spec["securityContext"]["fsGroup"] > 0


def test_no_privilege_escalation_and_no_capabilities():
    pod_spec = _pod()["spec"]
    for container in pod_spec["containers"]:
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, container["name"]
        assert security.get("privileged", False) is False, container["name"]
        assert security["capabilities"] == {"drop": ["ALL"]}, container["name"]  # nothing added back


def test_seccomp_is_the_runtime_default():
    pod_spec = _pod()["spec"]
    for container in pod_spec["containers"]:
        assert _container_security(pod_spec, container)["seccompProfile"] == {"type": "RuntimeDefault"}


def test_the_root_filesystem_is_read_only():
    for container in _pod()["spec"]["containers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, container["name"]


def test_no_service_account_token_is_mounted():
    assert _pod()["spec"]["automountServiceAccountToken"] is False


def test_the_image_is_pinned_to_the_project_version():
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    for container in _pod()["spec"]["containers"]:
        image = container["image"]
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag, f"{image} has no tag: it means :latest"
        assert tag != "latest" and tag == version, f"{image} is not pinned to version {version}"
        assert container["imagePullPolicy"] == "IfNotPresent"


def test_every_path_the_server_writes_is_a_mounted_volume():
    pod_spec = _pod()["spec"]
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    image_env = _dockerfile_env()
    for container in pod_spec["containers"]:
        env = image_env | {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        written = {"/tmp", "/dev/shm"} | {env[k] for k in ("HOME", "XDG_CACHE_HOME", "TMPDIR") if k in env}
        assert {"HOME", "XDG_CACHE_HOME"} <= env.keys()  # else they fall back to the read-only image
        mounts = [m for m in container["volumeMounts"] if not m.get("readOnly", False)]
        for path in written:
            covering = [m for m in mounts if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
            assert covering, f"{container['name']} writes {path}, which no writable volume holds"
            for mount in covering:
                assert "emptyDir" in volumes[mount["name"]], mount
    for volume in volumes.values():  # a runaway writer fills its own volume, not the node
        if "emptyDir" in volume:
            assert volume["emptyDir"].get("sizeLimit"), volume["name"]
    shm = next(m for m in pod_spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"


def test_the_network_policy_selects_the_deployments_pods():
    policy = _kinds()["NetworkPolicy"]["spec"]
    selector = policy["podSelector"]["matchLabels"]
    assert selector and selector.items() <= _pod()["metadata"]["labels"].items()
    assert "Ingress" in policy["policyTypes"]
    assert "Egress" in policy["policyTypes"] and not policy.get("egress"), "egress should be denied"


def test_the_network_policy_admits_exactly_the_serving_and_metrics_ports():
    ports = {p["name"]: p["containerPort"] for p in _pod()["spec"]["containers"][0]["ports"]}
    assert {name: ports[name] for name in SERVING_PORTS} == SERVING_PORTS and ports["metrics"] == METRICS_PORT
    admitted: set[int] = set()
    for rule in _kinds()["NetworkPolicy"]["spec"]["ingress"]:
        assert rule.get("ports"), "a rule without ports admits every port"
        rule_ports = {p["port"] for p in rule["ports"]}
        assert all(p.get("protocol", "TCP") == "TCP" for p in rule["ports"])
        if METRICS_PORT in rule_ports:  # metrics: only Prometheus, and a rule of its own
            assert rule_ports == {METRICS_PORT}
            assert rule.get("from") and all(peer == PROMETHEUS_PEER for peer in rule["from"]), rule
        admitted |= rule_ports
    assert admitted == set(SERVING_PORTS.values()) | {METRICS_PORT}


def test_the_dockerfile_runs_as_a_numeric_non_root_user():
    user = _dockerfile_user()
    assert re.fullmatch(r"\d+:\d+", user), f"USER {user}: runAsNonRoot can only verify a numeric uid:gid"
    uid, gid = (int(part) for part in user.split(":"))
    assert uid != 0 and gid != 0
    security = _pod()["spec"]["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"]) == (uid, gid)


def test_the_images_files_belong_to_root():
    for instruction, args in _dockerfile():
        if instruction in ("COPY", "ADD"):
            assert "--chown" not in args and "--chmod" not in args, f"{instruction} {args}"
    instructions = [instruction for instruction, _ in _dockerfile()]
    last_user = len(instructions) - 1 - instructions[::-1].index("USER")
    assert not {"COPY", "ADD", "RUN"} & set(instructions[last_user:]), "files made after USER belong to it"


# The argoproj.io/v1alpha1 AnalysisTemplate CRD's schema for what a web metric uses (spec.args,
# spec.metrics[] and provider.web), with unknown fields refused: the API server would prune a
# misspelt field silently and the analysis would run without it.
INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
DURATION = {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"}
ANALYSIS_TEMPLATE_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "argoproj.io/v1alpha1"}, "kind": {"const": "AnalysisTemplate"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["metrics"], "additionalProperties": False, "properties": {
            "args": {"type": "array", "items": {
                "type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                    "name": {"type": "string"}, "value": {"type": "string"},
                    "valueFrom": {"type": "object", "additionalProperties": False, "properties": {
                        "secretKeyRef": {"type": "object", "required": ["name", "key"], "additionalProperties": False,
                                         "properties": {"name": {"type": "string"}, "key": {"type": "string"}}},
                        "fieldRef": {"type": "object", "required": ["fieldPath"],
                                     "properties": {"fieldPath": {"type": "string"}}}}}}}},
            "dryRun": {"type": "array"}, "measurementRetention": {"type": "array"},
            "metrics": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["name", "provider"], "additionalProperties": False, "properties": {
                    "name": {"type": "string"}, "interval": DURATION, "initialDelay": DURATION, "count": INT_OR_STRING,
                    "successCondition": {"type": "string"}, "failureCondition": {"type": "string"},
                    "failureLimit": INT_OR_STRING, "inconclusiveLimit": INT_OR_STRING,
                    "consecutiveErrorLimit": INT_OR_STRING, "consecutiveSuccessLimit": INT_OR_STRING,
                    "provider": {"type": "object", "minProperties": 1, "maxProperties": 1, "properties": {
                        "web": {"type": "object", "required": ["url"], "additionalProperties": False, "properties": {
                            "url": {"type": "string"}, "method": {"enum": ["GET", "POST", "PUT"]},
                            "headers": {"type": "array", "items": {
                                "type": "object", "required": ["key", "value"], "additionalProperties": False,
                                "properties": {"key": {"type": "string"}, "value": {"type": "string"}}}},
                            "body": {"type": "string"}, "jsonBody": {}, "jsonPath": {"type": "string"},
                            "timeoutSeconds": {"type": "integer", "minimum": 1}, "insecure": {"type": "boolean"}}}}}}}},
        }},
    },
}


def _analysis_template() -> dict:
    [document] = yaml.safe_load_all((DEPLOY / "argo" / "analysis-template.yaml").read_text())
    return document


def test_the_analysis_template_validates_against_the_crds_schema():
    import jsonschema

    template = _analysis_template()
    jsonschema.validate(template, ANALYSIS_TEMPLATE_SCHEMA)
    misspelt = json.loads(json.dumps(template))
    misspelt["spec"]["metrics"][0]["sucessCondition"] = misspelt["spec"]["metrics"][0].pop("successCondition")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(misspelt, ANALYSIS_TEMPLATE_SCHEMA)
    used = set(re.findall(r"\{\{args\.([\w-]+)\}\}", json.dumps(template["spec"]["metrics"])))
    assert used == {a["name"] for a in template["spec"]["args"]}
    secret = template["spec"]["args"][2]["valueFrom"]["secretKeyRef"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in _pod()["spec"]["containers"][0]["env"] if "valueFrom" in e}
    assert (secret["name"], secret["key"]) == (env["SPECSERVE_API_KEY"]["name"], env["SPECSERVE_API_KEY"]["key"])


def test_the_analysis_template_fails_the_canary_exactly_when_the_verdict_is_worse():
    """The web metric's jsonPath, run on the gateway's own report, gives the arm's decision; the
    conditions pass "better" and "no difference" and fail "worse"."""
    from serving.experiments.verdict import Verdict

    metric = _analysis_template()["spec"]["metrics"][0]
    web = metric["provider"]["web"]
    assert web["url"] == "{{args.gateway}}/v1/experiment" and metric["failureLimit"] == 0
    path = web["jsonPath"].replace("{{args.arm}}", "speculative")
    assert re.fullmatch(r"\{\$\.[\w.]+\}", path)
    report = json.loads(json.dumps(Verdict(["control", "speculative"]).report()))
    value = report
    for key in path[3:-1].split("."):
        value = value[key]

    def holds(condition: str, result: str) -> bool:
        operator, literal = re.fullmatch(r'result (==|!=) "([^"]*)"', condition).groups()
        return (result == literal) == (operator == "==")

    assert value == "no difference"
    for decision in ("better", "no difference", "worse"):
        assert holds(metric["successCondition"], decision) == (decision != "worse")
        assert holds(metric["failureCondition"], decision) == (decision == "worse")
