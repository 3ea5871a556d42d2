"""llm_engine with `engine_process: "true"`: the engine core in a process of its own gives what the
in-process engine gives, and a core killed mid-stream ends its clients' streams with an error
within seconds, the model reports not ready, and no process outlives the server."""
from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from client.stream import GenerationError, complete
from tests.server.conftest import FAULT_SEED, start_test_server, wait_until_unloaded

pytestmark = pytest.mark.server

PROMPTS = ["def parse(", "class Stack:", "import os\n", "for i in range(", "while True:", "return [",
           "with open(", "if __name__"]


@pytest.fixture(scope="module")
def core_server(tmp_path_factory):
    server = start_test_server(tmp_path_factory.mktemp("core"), f"seed={FAULT_SEED}", {"engine_process": "true"})
    yield server
    server.handle.stop()


def _texts(server, prompts: list[str], max_tokens: int = 24) -> list[str]:
    def one(prompt: str) -> str:
        return complete(server.grpc_url, prompt, stream=True, max_tokens=max_tokens, temperature=0.0,
                        ignore_eos=True, timeout=120).text

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _cores(server) -> list[psutil.Process]:
    tritonserver = psutil.Process(server.handle.process.pid)
    return [p for p in tritonserver.children(recursive=True) if "backend.process.engine_core" in " ".join(p.cmdline())]


def _kill_mid_stream(server, victim: psutil.Process) -> None:
    """SIGKILL `victim` while 4 streams generate: each ends with the engine's error within 10 s."""
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(_texts, server, [p], 1500) for p in PROMPTS[:4]]
        time.sleep(1.0)  # generating
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for future in running:
            with pytest.raises(GenerationError, match="the engine has failed"):
                future.result(timeout=30)
        assert time.monotonic() - killed < 10


def test_streams_equal_the_in_process_engine(core_server, server):
    assert len(_cores(core_server)) == 1 and not _cores(server)
    assert _texts(core_server, PROMPTS) == _texts(server, PROMPTS)


def test_a_killed_core_ends_streams_with_an_error_and_leaves_no_process(core_server):
    (core,) = _cores(core_server)
    _kill_mid_stream(core_server, core)
    wait_until_unloaded(core_server, "llm_engine")
    assert core_server.handle.process.poll() is None  # the server lives on
    assert not _cores(core_server)


def test_stopping_the_server_stops_the_core(tmp_path):
    server = start_test_server(tmp_path, "", {"engine_process": "true"})
    (core,) = _cores(server)
    assert _texts(server, PROMPTS[:1], 4)[0]
    server.handle.stop()
    core.wait(timeout=30)  # raises if it outlived the server


def test_a_killed_server_leaves_no_core(tmp_path):
    server = start_test_server(tmp_path, "", {"engine_process": "true"})
    (core,) = _cores(server)
    server.handle.process.send_signal(signal.SIGKILL)  # no shutdown at all
    server.handle.process.wait(timeout=30)
    core.wait(timeout=30)  # its stub's exit orphans it, and it notices (raises if it lives on)
    server.handle.stop()


def _workers(server) -> list[psutil.Process]:
    tritonserver = psutil.Process(server.handle.process.pid)
    return [p for p in tritonserver.children(recursive=True) if "backend.parallel.worker" in " ".join(p.cmdline())]


def test_tensor_parallel_streams_equal_tp1_and_a_killed_worker_ends_them(tmp_path, server):
    tp = start_test_server(tmp_path, "", {"tensor_parallel_size": "2"})
    try:
        (worker,) = _workers(tp)
        prompts = PROMPTS * 2  # 16 concurrent streams
        assert _texts(tp, prompts) == _texts(server, prompts)
        _kill_mid_stream(tp, worker)
    finally:
        tp.handle.stop()
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE  # dead, if not reaped yet
