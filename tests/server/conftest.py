"""A real tritonserver for the server tests: one per session, on free ports, via serving.launch.launcher.

It serves a copy of the repository's model_repository (the same configs and model code) whose
model paths point at the tiny committed pair in tests/fixtures/tiny_pair, which keeps the suite
fast where the model does not matter. Tests of the default model itself (SmolLM2-135M-Instruct,
converted at set-up into `model_repository/llm_engine/1/target`) pass `model_dir=DEFAULT_MODEL`.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from serving.launch.launcher import DEFAULT_MODEL_REPOSITORY, ServerHandle, free_ports, start_server
from serving.launch.repository_variants import add_variant
from tests.conftest import free_port

pytestmark = pytest.mark.server
# a request with this seed raises inside a step after two tokens (backend/core/fault_injection.py)
FAULT_SEED = 4242
# the default model: SmolLM2-135M-Instruct, converted at set-up (scripts/convert_default_model.py)
DEFAULT_MODEL = DEFAULT_MODEL_REPOSITORY / "llm_engine" / "1" / "target"
# what the server tests serve unless they ask for the default model: a 12.6M-parameter Llama and
# its 1.4M draft trained on Python's standard library (scripts/train_default_models.py)
TEST_PAIR = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_pair"
TEST_MODEL = TEST_PAIR / "target"
TEST_DRAFT = TEST_PAIR / "draft"


@dataclass
class Server:
    handle: ServerHandle
    model_dir: Path  # the checkpoint llm_engine serves (tokenizer included)

    @property
    def grpc_url(self) -> str:
        return self.handle.grpc_url

    @property
    def http_url(self) -> str:
        return self.handle.http_url

    def metrics(self) -> dict[str, float]:
        """specserve_* samples by name plus labels, e.g. `specserve_request_success_total{finish_reason="stop"}`,
        summed over the engine's instances."""
        samples: dict[str, float] = {}
        for per_instance in self.instance_metrics().values():
            for key, value in per_instance.items():
                samples[key] = samples.get(key, 0.0) + value
        return samples

    def instance_metrics(self) -> dict[str, dict[str, float]]:
        """The samples of each instance (by its `model_instance` label)."""
        try:
            text = urllib.request.urlopen(self.handle.metrics_url, timeout=10).read().decode()
        except urllib.error.URLError as e:  # say whether the server is gone, and why
            exited = self.handle.process.poll()
            state = "running" if exited is None else f"exited with code {exited}"
            raise AssertionError(f"{self.handle.metrics_url}: {e}; tritonserver {state}; its log ends:\n"
                                 f"{self.handle.log_tail()}") from e
        instances: dict[str, dict[str, float]] = {}
        for m in re.finditer(r"^(specserve_\w+)(?:\{([^}]*)\})? (\S+)$", text, re.M):
            name, labels, value = m.groups()
            labels = [label for label in (labels or "").split(",") if label]
            instance = next((label.split("=", 1)[1].strip('"') for label in labels if label.startswith("model_instance=")), "")
            extra = [label for label in labels if not label.startswith(("model=", "version=", "model_instance="))]
            instances.setdefault(instance, {})[name + ("{" + ",".join(extra) + "}" if extra else "")] = float(value)
        return instances

    def wait_for_metrics(self, predicate, timeout: float = 20.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            samples = self.metrics()
            if predicate(samples) or time.monotonic() > deadline:
                return samples
            time.sleep(0.1)


def idle(samples: dict[str, float]) -> bool:
    """Server.metrics() of an engine with no request running and every KV block free."""
    return (
        samples["specserve_num_requests_running"] == 0
        and samples["specserve_kv_cache_free_blocks"] == samples["specserve_kv_cache_total_blocks"]
    )


def model_ready(server: Server, model: str) -> bool:
    """Whether the model reports ready; a server too busy loading models to answer within 10 s
    (a reload on a loaded machine) is not ready yet. A refused connection still raises."""
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/ready", timeout=10) as r:
            return r.status == 200
    except (urllib.error.HTTPError, TimeoutError):
        return False
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            return False
        raise


def wait_until_unloaded(server: Server, model: str, timeout: float = 30.0) -> None:
    """A model whose engine failed unloads itself: wait for it to report not ready."""
    deadline = time.monotonic() + timeout
    while model_ready(server, model) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not model_ready(server, model)


EAGER_FLOAT32 = {"dtype": "float32", "quantization": "none", "compile_decode": "false", "compile_prefill": "false"}


def _repository_with_parameters(root: Path, parameters: dict[str, str], engine_config: str = "",
                                model_dir: Path = TEST_MODEL, draft_dir: Path = TEST_DRAFT) -> Path:
    """A copy of the default model repository serving `model_dir` (and `draft_dir` where a config
    names the draft) by absolute path, with some of llm_engine's parameters set; `engine_config`
    replaces llm_engine's instance_group line (instance groups, a queue policy). Another model than
    the default is served without speculation unless `parameters` ask for it."""
    repository = root / "model_repository"
    # eager float32 unless a test asks for more: the shipped "auto" compiles at every start
    # (test_server_compiled_decode.py serves the shipped configuration)
    parameters = {**EAGER_FLOAT32, **parameters}
    if model_dir != DEFAULT_MODEL:  # the default config's EAGLE head is the default model's
        parameters = {"speculative_method": "none", "draft_model": "", **parameters}
    for model in ("preprocessing", "llm_engine", "llm", "llm_bls", "trtllm_preprocessing", "ensemble"):
        (repository / model / "1").mkdir(parents=True)
        config = (DEFAULT_MODEL_REPOSITORY / model / "config.pbtxt").read_text()
        config = config.replace('"llm_engine/1/target"', f'"{model_dir}"')  # preprocessing
        config = config.replace('"1/target"', f'"{model_dir}"')  # llm_engine
        config = config.replace('"1/draft"', f'"{draft_dir}"')
        config = config.replace('"1/eagle"', f'"{DEFAULT_MODEL_REPOSITORY / "llm_engine" / "1" / "eagle"}"')
        for key, value in parameters.items():
            config, n = re.subn(rf'(key: "{key}", value: {{ string_value: )"[^"]*"', rf'\1"{value}"', config)
            assert model != "llm_engine" or n == 1, f"no parameter {key} in llm_engine's config"
        if model == "llm_engine" and engine_config:
            config, n = re.subn(r"^instance_group .*$", engine_config, config, flags=re.M)
            assert n == 1
        (repository / model / "config.pbtxt").write_text(config)
        for source in (DEFAULT_MODEL_REPOSITORY / model / "1").glob("*.py"):
            shutil.copy(source, repository / model / "1" / source.name)
    return repository


def start_test_server(root: Path, fault_injection: str, parameters: dict[str, str] | None = None,
                      engine_config: str = "", model_dir: Path = TEST_MODEL,
                      variants: dict[str, dict[str, str]] | None = None, extra_models: tuple[Path, ...] = ()) -> Server:
    """tritonserver on free ports over `model_dir` (the tiny test pair's target unless asked), its
    log in `root`; `parameters` set some of llm_engine's, `engine_config` replaces its
    instance_group line; `variants` adds `llm_<name>` over an llm_engine with those parameters;
    `extra_models` are model directories copied into the repository beside the others."""
    repository = _repository_with_parameters(root, parameters or {}, engine_config, model_dir)
    for model in extra_models:
        shutil.copytree(model, repository / model.name, ignore=shutil.ignore_patterns("__pycache__"))
    for suffix, changed in (variants or {}).items():
        add_variant(repository, suffix, changed)
    http_port, grpc_port, metrics_port = free_ports(3)
    handle = start_server(
        repository,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        log_file=root / "tritonserver.log",
        ready_timeout=600,
        extra_env={"SPECSERVE_FAULT_INJECTION": fault_injection},
    )
    return Server(handle, model_dir)


@contextmanager
def openai_server(server: Server, *args: str, env: dict[str, str] | None = None, secret: str = ""):
    """`python -m serving.gateway.server` in front of `server` on a free port: its base URL once
    /health answers. `secret` (an API key) must not appear in what it logs."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "serving.gateway.server", "--triton", server.grpc_url, "--port", str(port),
         "--host", "127.0.0.1", *args], cwd=Path(__file__).parents[2], env=os.environ | (env or {}),
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=2).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline and process.poll() is None, "the OpenAI server did not start"
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.seek(0)
        assert not secret or secret not in log.read()
        log.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    server = start_test_server(tmp_path_factory.mktemp("server"), f"seed={FAULT_SEED}")
    yield server
    server.handle.stop()


@pytest.fixture(scope="session")
def tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model_dir)


@pytest.fixture(scope="session")
def smol_server(tmp_path_factory) -> Server:
    """The default model (SmolLM2-135M-Instruct) served as `make serve` serves it."""
    server = start_test_server(tmp_path_factory.mktemp("smollm2"), "", model_dir=DEFAULT_MODEL)
    yield server
    server.handle.stop()
