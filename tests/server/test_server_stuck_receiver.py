"""A receiver that stops taking responses stalls no one else's, through a real tritonserver.

llm_engine sends its responses with `InferenceResponseSender.send()`, which waits (no timeout)
until the server has handed the response to its receiver. When the receiver is a BLS caller
(llm_bls), from the second response on the server puts the response on the caller's stub message
queue and waits until that stub has taken it. Here llm_bls's stub process is frozen (SIGSTOP) in
the middle of a long stream; healthy clients of the `llm` ensemble must still get their streams
meanwhile, and once the stub runs again (SIGCONT) the llm_bls stream must end (however the
server chose to end it) and the engine come back to idle with every KV block free. Once briefly,
once for longer than llm_engine waits on one send before it gives that receiver up. The stub is
frozen, so these tests have a server of their own.
"""
from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import psutil
import pytest

from backend.errors import INTERNAL_ERROR
from client.stream import GenerationError, generate
from tests.server.conftest import idle, start_test_server

pytestmark = pytest.mark.server

BLS_MAX_TOKENS = 1500  # long enough to still be running when its stub is frozen
BLS_RESPONSE_TIMEOUT_S = 30.0  # once the stub runs again, each llm_bls response comes within this
HEALTHY_MAX_TOKENS = 32
# what a healthy request may take while llm_bls is frozen; alone it takes well under 2 s
HEALTHY_BOUND_S = 30.0
LONG_FREEZE_S = 13.0  # past llm_engine's SEND_TIMEOUT_S (10 s)


@pytest.fixture(scope="module")
def stuck_server(tmp_path_factory):
    server = start_test_server(tmp_path_factory.mktemp("stuck"), "")
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


def _bls_stream_started(server):
    """A long llm_bls stream that has relayed a few chunks."""
    bls = generate(
        server.grpc_url, "Once upon a time", model="llm_bls", max_tokens=BLS_MAX_TOKENS, ignore_eos=True,
        temperature=0, return_finish_reason=True, timeout=BLS_RESPONSE_TIMEOUT_S,
    )
    for _ in range(3):
        assert not next(bls).final
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
            f"llm_bls's stub was stopped; they ended {time.monotonic() - stalled:.2f} s after it was "
            "continued: llm_engine's responses wait behind one its frozen receiver does not take"
        )
    results = [future.result() for future in healthy]
    assert [tokens for _, tokens in results] == [HEALTHY_MAX_TOKENS] * num_requests
    return [took for took, _ in results]


def _ending(bls) -> str:
    """How the llm_bls stream ends: its finish reason, or the error it ends with."""
    ending = "no final response"
    try:
        for chunk in bls:
            if chunk.final:
                ending = chunk.finish_reason or "final"
    except GenerationError as e:
        ending = f"error: {e}"
    return ending


def _assert_ended(ending: str) -> None:
    assert not ending.startswith("error: no response within"), (
        f"the llm_bls stream got no response for {BLS_RESPONSE_TIMEOUT_S:.0f} s after its stub was "
        "continued: it never ends"
    )
    assert ending != "no final response"


def test_a_frozen_bls_receiver_stalls_no_other_stream(stuck_server):
    server = stuck_server
    server.wait_for_metrics(idle)
    alone, tokens = _healthy_request(server)  # also warms the path up
    assert tokens == HEALTHY_MAX_TOKENS
    assert alone < 5

    bls = _bls_stream_started(server)
    try:
        stub = _stub_process(server, "llm_bls")
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
    replaced): every healthy stream ends in time, and once the stub runs again the llm_bls stream
    ends too, with an internal error (the engine gave it up)."""
    server = stuck_server
    server.wait_for_metrics(idle)
    bls = _bls_stream_started(server)
    try:
        stub = _stub_process(server, "llm_bls")
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
