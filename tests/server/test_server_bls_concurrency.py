"""llm_bls under more concurrent streams than the engine runs at once plus the python backend's
thread pool (thread-pool-size, default 32): the streams the engine runs are relayed as they go,
cancelled streams end, and the stub survives the flood.

When llm_bls reached llm_engine through BLS, each call held a thread of that pool until the
engine's first response, and the same pool carries llm_bls's responses to its clients: unbounded,
the requests queued in the engine took the whole pool and no client got a response until a running
request ended; and such floods corrupted the stub's heap now and then (serving/triton/engine_stream.py).
The checks below are orderings, not timings: did the streams get responses before the engine
finished any request?
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from client.stream import GenerationError, generate
from tests.server.conftest import idle, start_test_server

pytestmark = pytest.mark.server

PYTHON_BACKEND_THREAD_POOL_SIZE = 32  # the python backend's default thread-pool-size
# the engine here runs this many requests at once, so that a few more streams than it runs plus
# the pool are queued in the engine
MAX_NUM_SEQS = 16
STREAMS = MAX_NUM_SEQS + PYTHON_BACKEND_THREAD_POOL_SIZE + 8
MAX_TOKENS = 64
LENGTH = 'specserve_request_success_total{finish_reason="length"}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of its own: these tests flood llm_bls, and a failure here must not reach the
    tests that share the session's server."""
    server = start_test_server(tmp_path_factory.mktemp("bls"), "", {"max_num_seqs": str(MAX_NUM_SEQS)})
    yield server
    server.handle.stop()


class Stream:
    """One llm_bls request on its own gRPC stream; records when its responses arrive."""

    def __init__(self, url: str, index: int):
        self.first: float | None = None  # time.monotonic() of the first response
        self.final: float | None = None  # ... and of the final one
        self.error = None
        self.done = threading.Event()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_response)
        prompt = np.array([f"def f{index}(x):".encode()], dtype=np.object_)
        self.inputs = [
            _tensor("text_input", prompt, "BYTES"),
            _tensor("stream", np.array([True]), "BOOL"),
            _tensor("max_tokens", np.array([MAX_TOKENS], dtype=np.int32), "INT32"),
            _tensor("ignore_eos", np.array([True]), "BOOL"),
            _tensor("temperature", np.array([0.0], dtype=np.float32), "FP32"),
        ]

    def start(self) -> None:
        self.client.async_stream_infer("llm_bls", self.inputs, enable_empty_final_response=True)

    def _on_response(self, result, error) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
        if error is not None:
            self.error = error
        if error is not None or _is_final(result):
            self.final = now
            self.done.set()

    def close(self, cancel: bool = False) -> None:
        # a stream still open is cancelled: stop_stream would otherwise wait for its end forever
        self.client.stop_stream(cancel_requests=cancel or not self.done.is_set())
        self.client.close()


def _is_final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def _tensor(name, array, datatype):
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _open_streams(server, count: int) -> list[Stream]:
    streams = [Stream(server.grpc_url, i) for i in range(count)]
    for stream in streams:
        stream.start()
    return streams


def _first_engine_request_done(server, stop: threading.Event) -> list[float]:
    """Starts a thread that notes (in the list it returns) the time.monotonic() at which the
    engine's count of requests finished by length first grows."""
    before = server.metrics()[LENGTH]
    noted: list[float] = []

    def watch():
        while not stop.is_set() and not noted:
            if server.metrics()[LENGTH] > before:
                noted.append(time.monotonic())
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    return noted


def test_streams_past_the_thread_pool_are_relayed_as_they_go(server):
    server.wait_for_metrics(idle)
    stop = threading.Event()
    engine_done = _first_engine_request_done(server, stop)
    streams = _open_streams(server, STREAMS)
    deadline = time.monotonic() + 300
    try:
        for stream in streams:
            assert stream.done.wait(max(0.0, deadline - time.monotonic())), (
                f"{sum(not s.done.is_set() for s in streams)} of {len(streams)} streams had no "
                f"final response after 300 s; the server's log ends:\n{server.handle.log_tail()}"
            )
    finally:
        stop.set()
        for stream in streams:
            stream.close()
    assert [s.error for s in streams if s.error is not None] == []
    assert engine_done, "the engine finished no request (or its metric did not say so)"
    relayed_early = sum(s.first < engine_done[0] for s in streams)
    # The engine runs MAX_NUM_SEQS requests at once, each relayed from its first step on (all of
    # them were here). Unbounded, only those relayed before the pool filled up were.
    assert relayed_early >= MAX_NUM_SEQS * 3 // 4, (
        f"{relayed_early} of {len(streams)} streams had a response before the engine finished "
        "its first request"
    )


def test_cancelling_streams_queued_in_the_engine_ends_them(server):
    """Streams cancelled while most of them wait in the engine's queue end, and the engine is
    left idle."""
    server.wait_for_metrics(idle)
    streams = _open_streams(server, STREAMS)
    deadline = time.monotonic() + 120
    while not any(s.first for s in streams) and time.monotonic() < deadline:
        time.sleep(0.05)
    for stream in streams:
        stream.close(cancel=True)
    assert idle(server.wait_for_metrics(idle, timeout=60)), server.handle.log_tail()
    # nothing was left holding a place: a new request goes through
    chunks = generate(
        server.grpc_url, "def main():", model="llm_bls", max_tokens=4, temperature=0,
        ignore_eos=True, return_finish_reason=True, timeout=60,
    )
    try:
        last = list(chunks)[-1]
    except GenerationError as e:  # the server's log says where the request stopped
        raise AssertionError(f"{e}; the server's log ends:\n{server.handle.log_tail()}") from e
    assert last.finish_reason == "length"
