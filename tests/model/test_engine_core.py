"""The engine core in its own process (EngineCoreClient): the same outputs as the engine in this
process, bad requests refused at once, a dead core ends every request with ENGINE_DEAD, and no
process outlives the client; its sockets are in a private directory, and a crafted message on
either runs nothing and stops nothing."""
from __future__ import annotations

import os
import signal
import stat
import threading
import time

import pytest
import zmq

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.process.engine_core_client import EngineCoreClient
from backend.engine_loop import EngineLoop
from backend.errors import ENGINE_DEAD, EngineDeadError, ValidationError
from backend.sampling_params import SamplingParams
from tests.unit.test_wire import crafted_pickle


class Collector:
    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, object] = {}
        self.done = threading.Event()
        self.expected = 0
        self.lock = threading.Lock()

    def __call__(self, output) -> None:
        with self.lock:
            self.tokens.setdefault(output.request_id, []).extend(output.token_ids)
            if output.finished:
                self.final[output.request_id] = output
                if len(self.final) == self.expected:
                    self.done.set()

    def all_generating(self, n: int, timeout: float = 30.0) -> bool:
        """Wait until n requests have tokens out; True if then none has finished."""
        deadline = time.monotonic() + timeout
        while len(self.tokens) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        with self.lock:
            return len(self.tokens) == n and not self.final


def requests() -> list[tuple[list[int], SamplingParams]]:
    return [([(5 * i + j) % 200 + 3 for j in range(4 + 3 * i)],
             SamplingParams(max_tokens=10 + i, temperature=0.0 if i % 2 else 0.8, seed=50 + i, ignore_eos=True))
            for i in range(6)]


def run(loop, work) -> Collector:
    collector = Collector()
    collector.expected = len(work)
    loop.start()
    for i, (prompt, params) in enumerate(work):
        loop.submit(prompt, params, collector, f"r{i}")
    assert collector.done.wait(120)
    return collector


def generating(config: EngineConfig, n: int) -> tuple[EngineCoreClient, Collector]:
    """A core given n long requests."""
    client, collector = EngineCoreClient(config), Collector()
    collector.expected = n
    client.start()
    for i in range(n):
        client.submit([3, 4, 5, 6], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), collector, f"r{i}")
    return client, collector


@pytest.fixture
def config(tiny_llama) -> EngineConfig:
    return EngineConfig(model=str(tiny_llama), block_size=8, num_kv_blocks=64)


def test_the_core_process_gives_what_the_engine_gives_in_process(config):
    local = EngineLoop(LLMEngine(config))
    expected = run(local, requests())
    local.shutdown()
    client = EngineCoreClient(config)
    try:
        got = run(client, requests())
        assert got.tokens == expected.tokens
        assert {rid: o.finish_reason for rid, o in got.final.items()} == {rid: "length" for rid in expected.final}
        assert client.stats().num_total_blocks == 64
        with pytest.raises(ValidationError, match="prompt_token_ids"):  # refused here, at once
            client.submit([], SamplingParams(), lambda output: None)
    finally:
        client.shutdown()
    assert client.process.poll() is not None


def test_a_dead_core_ends_every_request_and_refuses_new_ones(config):
    client, collector = generating(config, 3)
    assert collector.all_generating(3)  # each has tokens out and none has finished when the core dies
    os.kill(client.process.pid, signal.SIGKILL)
    assert collector.done.wait(10)
    assert {o.error for o in collector.final.values()} == {ENGINE_DEAD}
    assert all(len(tokens) < 400 for tokens in collector.tokens.values())  # ended by the death, not by length
    assert client.dead
    with pytest.raises(EngineDeadError):
        client.submit([3, 4], SamplingParams(max_tokens=2), collector)
    client.shutdown()


def test_shutdown_ends_requests_in_flight_and_leaves_no_process(config):
    client, collector = generating(config, 2)
    assert collector.all_generating(2)  # shut down mid-generation
    client.shutdown()
    assert collector.done.is_set()
    assert {o.finish_reason for o in collector.final.values()} == {"abort"}
    assert client.process.poll() == 0


def test_a_core_that_cannot_start_says_why(config, tmp_path):
    config.model = str(tmp_path)  # past the config's checks: no checkpoint there
    with pytest.raises(RuntimeError, match="failed to start"):
        EngineCoreClient(config)


def test_the_sockets_live_in_a_private_directory_removed_at_shutdown(config):
    client = EngineCoreClient(config)
    try:
        directory = client.directory
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert str(os.getpid()) not in os.path.basename(directory)
        assert sorted(os.listdir(directory)) == ["outputs", "requests"]
    finally:
        client.shutdown()
    assert not os.path.exists(directory)


def test_a_crafted_pickle_on_either_socket_runs_nothing_and_the_core_serves_on(config, tmp_path):
    marker = tmp_path / "marker"
    client = EngineCoreClient(config)
    intruder = zmq.Context().socket(zmq.PUSH)
    try:
        with client._send_lock:  # at the core's requests socket
            client.requests.send(crafted_pickle(marker))
            client.requests.send(b"\x92\xa3add\xa2r0")  # msgpack ["add", "r0"]: no request either
        intruder.connect(f"ipc://{client.directory}/outputs")  # at the client's outputs socket
        intruder.send(crafted_pickle(marker))
        got = run(client, requests()[:2])
        assert {rid: o.finish_reason for rid, o in got.final.items()} == {"r0": "length", "r1": "length"}
        assert not marker.exists()
        assert client.process.poll() is None and not client.dead
    finally:
        intruder.close(linger=0)
        client.shutdown()
    assert client.process.returncode == 0
