"""One request's fault harms no other, through a real tritonserver. A request that raises inside
a step (the test-only fault hook, keyed by its seed) beside 15 streams: it alone gets an internal
error that says nothing of the server, the 15 give their solo text. A fatal fault (what a CUDA
error is) on a server of its own: every request in flight ends with an error, new requests get
UNAVAILABLE at once, and llm_engine unloads itself so that it reports not ready."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from backend.errors import ENGINE_DEAD, INTERNAL_ERROR
from client.stream import GenerationError, complete
from tests.server.conftest import FAULT_SEED, model_ready, start_test_server

pytestmark = pytest.mark.server


def _streams() -> list[dict]:
    """15 streaming requests: greedy and seeded sampling, of different lengths."""
    return [
        dict(
            prompt=f"def function_{i}(x):",
            max_tokens=16 + 2 * i,
            temperature=0.0 if i % 2 else 0.8,
            seed=100 + i,
            ignore_eos=True,
        )
        for i in range(15)
    ]


def _run(server, request: dict) -> str:
    request = dict(request)
    return complete(server.grpc_url, request.pop("prompt"), stream=True, timeout=120, **request).text


def _faulty(server, model: str = "llm") -> str:
    try:
        complete(
            server.grpc_url, "import os", model=model, stream=True, max_tokens=64, seed=FAULT_SEED,
            ignore_eos=True, timeout=120,
        )
    except GenerationError as e:
        return str(e)
    return "completed"


@pytest.mark.parametrize("model", ["llm", "llm_bls"])
def test_a_faulting_request_fails_alone(server, model):
    """Through llm_bls too, whose BLS stream would never end on an error response that follows
    another response: llm_engine sends it the error in band."""
    solo = [_run(server, r) for r in _streams()]
    with ThreadPoolExecutor(16) as pool:
        fault = pool.submit(_faulty, server, model)
        together = list(pool.map(lambda r: _run(server, r), _streams()))
    assert fault.result() == INTERNAL_ERROR
    assert together == solo
    assert server.handle.is_ready()


@pytest.fixture(scope="module")
def doomed_server(tmp_path_factory):
    server = start_test_server(tmp_path_factory.mktemp("doomed"), f"fatal_seed={FAULT_SEED}")
    yield server
    server.handle.stop()


def test_a_fatal_fault_ends_everything_and_the_engine_reports_not_ready(doomed_server):
    server = doomed_server
    assert model_ready(server, "llm_engine")
    long = dict(prompt="class Parser:", max_tokens=1000, temperature=0.0, ignore_eos=True)
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(_run, server, long) for _ in range(2)]
        running.append(pool.submit(_run, server, long | {"model": "llm_bls"}))
        fault = pool.submit(_faulty, server)
        assert ENGINE_DEAD in fault.result()
        for future in running:
            with pytest.raises(GenerationError, match="the engine has failed"):
                future.result()
    with pytest.raises(GenerationError) as refused:  # at once: the engine, or no model at all
        complete(server.http_url, "hi", protocol="http", max_tokens=2, timeout=30)
    assert refused.value.status in ("503", "400", "404")  # 404: the ensemble has no model under it
    deadline = time.monotonic() + 30  # the unload runs in the background
    while model_ready(server, "llm_engine") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not model_ready(server, "llm_engine")
    assert server.handle.process.poll() is None  # the server itself lives on
