"""The engine core in its own process (EngineCoreClient): the same outputs as the engine in this
process, bad requests refused at once, a dead core ends every request with ENGINE_DEAD, and no
process outlives the client."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.engine_core_client import EngineCoreClient
from backend.engine_loop import EngineLoop
from backend.errors import ENGINE_DEAD, EngineDeadError, ValidationError
from backend.sampling_params import SamplingParams


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
    """A core generating n long requests (the first tokens are out)."""
    client, collector = EngineCoreClient(config), Collector()
    collector.expected = n
    client.start()
    for i in range(n):
        client.submit([3, 4, 5, 6], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), collector, f"r{i}")
    while not collector.tokens:
        time.sleep(0.01)
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
        assert client.engine.stats().num_total_blocks == 64
        with pytest.raises(ValidationError, match="prompt_token_ids"):  # refused here, at once
            client.submit([], SamplingParams(), lambda output: None)
    finally:
        client.shutdown()
    assert client.process.poll() is not None


def test_a_dead_core_ends_every_request_and_refuses_new_ones(config):
    client, collector = generating(config, 3)
    os.kill(client.process.pid, signal.SIGKILL)
    started = time.monotonic()
    assert collector.done.wait(10)
    assert time.monotonic() - started < 10
    assert {o.error for o in collector.final.values()} == {ENGINE_DEAD}
    assert client.dead
    with pytest.raises(EngineDeadError):
        client.submit([3, 4], SamplingParams(max_tokens=2), collector)
    client.shutdown()


def test_shutdown_ends_requests_in_flight_and_leaves_no_process(config):
    client, collector = generating(config, 2)
    client.shutdown()
    assert collector.done.is_set()
    assert {o.finish_reason for o in collector.final.values()} == {"abort"}
    assert client.process.poll() == 0


def test_a_core_that_cannot_start_says_why(config, tmp_path):
    config.model = str(tmp_path)  # past the config's checks: no checkpoint there
    with pytest.raises(RuntimeError, match="failed to start"):
        EngineCoreClient(config)
