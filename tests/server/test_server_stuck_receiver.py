"""A receiver that stops taking responses stalls no one else's, through a real tritonserver.

llm_engine sends its responses with `InferenceResponseSender.send()`, which waits (no timeout)
until the server has handed the response to its receiver. When the receiver is a BLS caller, from
the second response on the server puts the response on the caller's stub message queue and waits
until that stub has taken it. The caller here is `bls_relay` (tests/server/bls_relay, a test-only
model that forwards llm_engine's inputs through decoupled BLS), whose stub process is frozen
(SIGSTOP) in the middle of a long stream; healthy clients of the `llm` ensemble must still get
their streams meanwhile, and once the stub runs again (SIGCONT) the relayed stream must end
(however the server chose to end it) and the engine come back to idle with every KV block free.
Once briefly, once for longer than llm_engine waits on one send before it gives that receiver up.
The stub is frozen, so these tests have a server of their own.
"""
from __future__ import annotations

import json
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import numpy as np
import psutil
import pytest

from backend.errors import INTERNAL_ERROR
from client.stream import generate
from serving.triton.engine_stream import EngineStream, StreamError
from tests.server.conftest import idle, start_test_server

RELAY = Path(__file__).parent / "bls_relay"

pytestmark = pytest.mark.server

BLS_MAX_TOKENS = 1500  # long enough to still be running when its stub is frozen
BLS_RESPONSE_TIMEOUT_S = 30.0  # once the stub runs again, each relayed response comes within this
HEALTHY_MAX_TOKENS = 32
# what a healthy request may take while bls_relay is frozen; alone it takes well under 2 s
HEALTHY_BOUND_S = 30.0
LONG_FREEZE_S = 13.0  # past llm_engine's SEND_TIMEOUT_S (10 s)


@pytest.fixture(scope="module")
def stuck_server(tmp_path_factory):
    server = start_test_server(tmp_path_factory.mktemp("stuck"), "", extra_models=(RELAY,))
    yield server
    server.handle.stop()


def _stub_process(server, model: str) -> psutil.Process:
    """The python backend stub process that runs `model` (one instance)."""
    stubs = []
    for process in psutil.Process(server.handle.process.pid).children(recursive=True):
        try:
            cmdline = " ".join(process.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "triton_python_backend_stub" in cmdline and f"/{model}/" in cmdline:
            stubs.append(process)
    assert len(stubs) == 1, f"expected one {model} stub, found {[p.cmdline() for p in stubs]}"
    return stubs[0]


def _healthy_request(server) -> tuple[float, int | None]:
    """Seconds a greedy streamed `llm` request takes, and the output tokens it reports."""
    start = time.monotonic()
    chunks = list(generate(
        server.grpc_url, "def main():", model="llm", max_tokens=HEALTHY_MAX_TOKENS, ignore_eos=True,
        temperature=0, return_num_output_tokens=True, timeout=120,
    ))
    return time.monotonic() - start, sum(c.num_output_tokens for c in chunks)


def _bls_stream_started(server) -> EngineStream:
    """A long greedy stream through bls_relay that has relayed a few chunks."""
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(server.model_dir)("Once upon a time")["input_ids"]
    params = {"max_tokens": BLS_MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    options = {"stream": True, "return_finish_reason": True, "in_band_errors": True}
    bls = EngineStream(server.grpc_url, "bls_relay", uuid.uuid4().hex, {
        "input_ids": np.array(prompt_ids, dtype=np.int32),
        "sampling_params": np.array([json.dumps(params).encode()], dtype=np.object_),
        "request_options": np.array([json.dumps(options).encode()], dtype=np.object_),
    })
    for _ in range(3):
        _, last = bls.next(timeout=BLS_RESPONSE_TIMEOUT_S)
        assert not last
    return bls


def _healthy_requests_while_frozen(server, stub: psutil.Process, num_requests: int, hold_s: float) -> list[float]:
    """Freeze `stub`, run `num_requests` healthy `llm` streams at once, keep it frozen for at
    least `hold_s` and continue it (always). Each stream must end within HEALTHY_BOUND_S; the
    seconds each took."""
    pool = ThreadPoolExecutor(num_requests)
    stub.send_signal(signal.SIGSTOP)
    frozen = time.monotonic()
    stalled = None  # time.monotonic() when a stream was found late
    try:
        time.sleep(0.5)  # llm_engine sends the frozen stub's request more responses meanwhile
        healthy = [pool.submit(_healthy_request, server) for _ in range(num_requests)]
        deadline = time.monotonic() + HEALTHY_BOUND_S
        try:
            for future in healthy:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            stalled = time.monotonic()
        else:
            time.sleep(max(0.0, frozen + hold_s - time.monotonic()))
    finally:
        stub.send_signal(signal.SIGCONT)
        pool.shutdown(wait=False)
    if stalled is not None:  # how soon after SIGCONT they end tells what they waited for
        for future in healthy:
            future.result(timeout=60)
        late = sum(1 for future in healthy if future.result()[0] >= HEALTHY_BOUND_S)
        pytest.fail(
            f"{late} of {num_requests} `llm` streams got no end within {HEALTHY_BOUND_S:.0f} s while "
            f"bls_relay's stub was stopped; they ended {time.monotonic() - stalled:.2f} s after it was "
            "continued: llm_engine's responses wait behind one its frozen receiver does not take"
        )
    results = [future.result() for future in healthy]
    assert [tokens for _, tokens in results] == [HEALTHY_MAX_TOKENS] * num_requests
    return [took for took, _ in results]


def _ending(bls: EngineStream) -> str:
    """How the relayed stream ends: its finish reason, or the error it ends with."""
    while True:
        try:
            outputs, last = bls.next(timeout=BLS_RESPONSE_TIMEOUT_S)
        except StreamError as e:
            return f"error: {e}"
        error = _text(outputs, "error")
        if error:
            return f"error: {error}"
        reason = _text(outputs, "finish_reason")
        if reason not in ("", "None"):
            return reason
        if last:
            return "final"


def _text(outputs: dict, name: str) -> str:
    value = outputs.get(name)
    return value.reshape(-1)[0].decode() if value is not None and value.size else ""


def _assert_ended(ending: str) -> None:
    assert not ending.startswith("error: no response within"), (
        f"the relayed stream got no response for {BLS_RESPONSE_TIMEOUT_S:.0f} s after its stub was "
        "continued: it never ends"
    )


def test_a_frozen_bls_receiver_stalls_no_other_stream(stuck_server):
    server = stuck_server
    server.wait_for_metrics(idle)
    alone, tokens = _healthy_request(server)  # also warms the path up
    assert tokens == HEALTHY_MAX_TOKENS
    assert alone < 5

    bls = _bls_stream_started(server)
    try:
        stub = _stub_process(server, "bls_relay")
        [took] = _healthy_requests_while_frozen(server, stub, 1, hold_s=0.0)
        assert took < HEALTHY_BOUND_S
        _assert_ended(_ending(bls))
    finally:
        bls.close()  # cancels it if it is still open
    after = server.wait_for_metrics(idle, timeout=60)
    assert idle(after), after
    assert server.handle.is_ready()
    assert stub.is_running() and stub.status() != psutil.STATUS_STOPPED  # the same stub, running


def test_a_receiver_frozen_for_long_still_has_its_stream_ended(stuck_server):
    """Frozen for longer than llm_engine waits on one send (SEND_TIMEOUT_S, 10 s), beside several
    healthy streams (one of them shares the frozen request's sender lane until the lane is
    replaced): every healthy stream ends in time, and once the stub runs again the relayed stream
    ends too, with an internal error (the engine gave it up)."""
    server = stuck_server
    server.wait_for_metrics(idle)
    bls = _bls_stream_started(server)
    try:
        stub = _stub_process(server, "bls_relay")
        took = _healthy_requests_while_frozen(server, stub, 4, hold_s=LONG_FREEZE_S)
        assert max(took) < HEALTHY_BOUND_S
        ending = _ending(bls)
        _assert_ended(ending)
        assert ending == f"error: {INTERNAL_ERROR}"
    finally:
        bls.close()
    after = server.wait_for_metrics(idle, timeout=60)
    assert idle(after), after
    took, tokens = _healthy_request(server)
    assert tokens == HEALTHY_MAX_TOKENS
    assert stub.is_running() and stub.status() != psutil.STATUS_STOPPED
