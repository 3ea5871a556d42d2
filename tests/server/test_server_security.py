"""Attacks on the real server that must fail: the model-repository API without the admin key
(over HTTP and gRPC), and the admin key leaking into the log; and a server whose engine died heals
itself (the launcher's supervisor loads llm_engine again) without anyone acting."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.stream import GenerationError, complete
from serving.launch.launcher import ADMIN_HEADER, GRPC_ADMIN_HEADER
from serving.launch.supervisor import EngineSupervisor
from tests.server.conftest import model_ready, start_test_server, wait_until_unloaded

pytestmark = pytest.mark.server
FATAL_SEED = 4343


def _post(server, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize("path", ["/v2/repository/models/llm_engine/unload", "/v2/repository/models/llm_engine/load",
                                  "/v2/repository/models/llm/unload", "/v2/repository/index", "/v2/logging"])
def test_the_restricted_http_apis_refuse_a_client_without_the_key(server, path):
    for headers in (None, {ADMIN_HEADER: "not-the-key"}):
        status, body = _post(server, path, headers)
        assert status == 403, (path, status, body)
        assert "restricted" in body
    assert model_ready(server, "llm_engine") and model_ready(server, "llm")


def test_the_restricted_grpc_apis_refuse_a_client_without_the_key(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for call in (lambda: client.unload_model("llm_engine"), lambda: client.load_model("llm_engine"),
                 lambda: client.get_model_repository_index(),
                 lambda: client.unload_model("llm_engine", headers={GRPC_ADMIN_HEADER: "not-the-key"})):
        with pytest.raises(InferenceServerException, match="restricted"):
            call()
    assert client.is_model_ready("llm_engine") and client.is_model_ready("llm")
    client.close()


def test_with_the_key_the_repository_api_answers(server):
    status, body = _post(server, "/v2/repository/index", server.handle.admin_headers)
    assert status == 200
    assert {m["name"]: m["state"] for m in json.loads(body)}["llm_engine"] == "READY"
    client = grpcclient.InferenceServerClient(server.grpc_url)
    index = client.get_model_repository_index(headers=server.handle.grpc_admin_headers, as_json=True)
    assert "llm_engine" in {m["name"] for m in index["models"]}
    client.close()


def test_the_admin_key_is_not_in_the_log(server):
    assert len(server.handle.admin_key) >= 32
    log = server.handle.log_path.read_text(errors="replace")
    assert "llm_engine" in log  # the log is the server's
    assert server.handle.admin_key not in log


def test_a_server_whose_engine_died_serves_again_without_anyone_acting(tmp_path):
    """The fault hook kills the engine (a FatalEngineError, as a CUDA error would be): llm_engine
    unloads itself, the supervisor loads it again, and the same client request then succeeds."""
    server = start_test_server(tmp_path, f"fatal_seed={FATAL_SEED}")
    gave_up = []
    supervisor = EngineSupervisor(server.handle, lambda: gave_up.append(True), backoff_s=0.5, log=lambda _: None).start()
    try:
        assert complete(server.grpc_url, "Once upon a time", max_tokens=4, temperature=0).text
        with pytest.raises(GenerationError):
            complete(server.grpc_url, "Once upon a time", max_tokens=16, temperature=1.0, seed=FATAL_SEED,
                     ignore_eos=True)
        wait_until_unloaded(server, "llm_engine")
        deadline = time.monotonic() + 300
        while not (model_ready(server, "llm_engine") and model_ready(server, "llm")):
            assert time.monotonic() < deadline, "the engine was not loaded again"
            time.sleep(0.5)
        assert supervisor.reloads == 1 and not gave_up
        completion = complete(server.grpc_url, "Once upon a time", max_tokens=8, temperature=0, ignore_eos=True,
                              return_num_output_tokens=True)
        assert completion.num_output_tokens == 8
    finally:
        supervisor.stop()
        server.handle.stop()


def test_a_supervisor_that_cannot_bring_the_engine_back_gives_up(server):
    """Loads that keep failing end in give_up (the launcher then stops the server and exits 1, so
    that the container is restarted); here the model it watches cannot be loaded at all."""
    gave_up = []
    supervisor = EngineSupervisor(server.handle, lambda: gave_up.append(True), model="no_such_model",
                                  backoff_s=0.1, max_failed_loads=2, log=lambda _: None).start()
    try:
        deadline = time.monotonic() + 30
        while not gave_up:
            assert time.monotonic() < deadline, "the supervisor never gave up"
            time.sleep(0.1)
        assert supervisor.reloads == 0 and not supervisor.thread.is_alive()
        assert model_ready(server, "llm_engine")  # nothing else was touched
    finally:
        supervisor.stop()


def test_the_launcher_shuts_down_on_repeated_ctrl_c(tmp_path):
    """`make serve` as a user runs it: the launcher (with its supervisor and the OpenAI server),
    then Ctrl-C three times in a row. It stops tritonserver and exits, and nothing it started is
    left. (Its signal handler takes no lock: a signal that arrives while another is handled
    would otherwise deadlock it, which a test cannot time reliably.)"""
    from serving.launch.launcher import free_ports
    from tests.server.conftest import _repository_with_parameters

    repository = _repository_with_parameters(tmp_path, {})
    ports = [str(port) for port in free_ports(4)]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "serving.launch", "--model-repository", str(repository), "--http-port", ports[0],
         "--grpc-port", ports[1], "--metrics-port", ports[2], "--openai-port", ports[3], "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parents[2])
    try:
        for line in launcher.stdout:
            if "specserve is ready" in line:
                break
        else:
            pytest.fail("the launcher never became ready")
        assert complete(f"127.0.0.1:{ports[1]}", "Once upon a time", max_tokens=2, temperature=0).text is not None
        for _ in range(3):
            launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=90) in (0, -signal.SIGINT, 130)
        children = subprocess.run(["pgrep", "-f", f"--http-port={ports[0]}"], capture_output=True, text=True)
        assert children.stdout == ""  # no tritonserver left
    finally:
        launcher.kill()
        launcher.wait()
