"""The typed encodings of what crosses a process or host boundary: every message comes back as
it went, and bytes that are not the message expected (a crafted pickle above all) are refused
with WireError and run nothing."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.process import core_messages

from backend.parallel import wire
from backend.process.core_messages import AbortRequest, AddRequest, Dead, Failed, Output, Ready, Stats, StopRequest
from backend.outputs import EngineStats
from backend.model.model_runner import StepInput
from backend.outputs import RequestOutput
from backend.core.request_limits import RequestLimits
from backend.sampling_params import SamplingParams
from backend.parallel.wire import StepHeader, WireError


class _CreatesFile:
    """Unpickling this creates `path`: what an attacker's payload would do instead."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def crafted_pickle(marker: Path) -> bytes:
    return pickle.dumps(_CreatesFile(marker))


def test_the_crafted_pickle_would_run_if_unpickled(tmp_path):
    """The attack the other tests push is a real one."""
    pickle.loads(crafted_pickle(tmp_path / "marker")).close()
    assert (tmp_path / "marker").exists()


STATS = EngineStats(1, 2, 30, 64, 0.5, 10, 20, 0, 4, 8, 6, 3, [2, 1, 0])
OUTPUT = RequestOutput("r1", "hi", [7, 8], True, "stop", 3, 2,
                       logprobs=[{"token_id": 7, "logprob": -0.5, "rank": 1, "top": {7: -0.5, 9: -2.0},
                                  "text": {7: "h", 9: "x"}}], cumulative_logprob=-0.5, queue_seconds=0.25)


@pytest.mark.parametrize("message", [
    AddRequest("r1", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.5, stop=["x"], seed=2**64 - 1, logprobs=2)),
    AbortRequest("r1"),
    StopRequest(),
])
def test_engine_core_requests_come_back_as_they_went(message):
    assert core_messages.REQUESTS.decode(wire.encode(message)) == message


@pytest.mark.parametrize("message", [
    Ready(RequestLimits(256, 512, 16, 64), STATS), Failed("ValueError: no"), Output(OUTPUT), Stats(STATS), Dead(),
])
def test_engine_core_outputs_come_back_as_they_went(message):
    assert core_messages.OUTPUTS.decode(wire.encode(message)) == message


def test_a_crafted_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    for decoder in (core_messages.REQUESTS, core_messages.OUTPUTS, wire.STEPS):
        with pytest.raises(WireError, match=f"not {decoder.name}"):
            decoder.decode(crafted_pickle(marker))
    assert not marker.exists()


@pytest.mark.parametrize("message, error", [
    ({"type": "add", "request_id": "r", "prompt_ids": [1], "params": {"temperature": -1.0}}, "temperature"),
    ({"type": "add", "request_id": "r", "prompt_ids": ["1"]}, "Expected `int`"),
    ({"type": "exec", "code": "import os"}, "Invalid value 'exec'"),
    (["add", "r", [1]], "Expected `object`, got `array`"),
])
def test_a_request_of_the_wrong_shape_is_refused_naming_why(message, error):
    with pytest.raises(WireError, match=error):
        core_messages.REQUESTS.decode(wire.encode(message))


def test_a_request_output_to_the_wrong_socket_is_refused():
    with pytest.raises(WireError, match="not an engine-core request"):
        core_messages.REQUESTS.decode(wire.encode(Output(OUTPUT)))


@given(st.binary(max_size=64))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_decode_into_a_request_or_are_refused(data):
    try:
        message = core_messages.REQUESTS.decode(data)
    except WireError:
        return
    assert isinstance(message, (AddRequest, AbortRequest, StopRequest))


def _step(with_tensors: bool) -> StepInput:
    step = StepInput([], [], [], [])
    step.add([5, 0, 0], 4, [0, 1], 2)
    if with_tensors:
        step.take_from_device([1, 0], at=[1, 2])
    step.add([9], 17, [2, 3], 1)
    if with_tensors:
        step.device_tokens = torch.tensor([11, 12, 13])
        step.position_offsets = torch.tensor([0, -2])
        step.block_copies = [(7, 1, 3)]
    return step


@pytest.mark.parametrize("with_tensors", [False, True])
def test_a_step_comes_back_as_it_went(with_tensors):
    step = _step(with_tensors)
    header, tensors = StepHeader.of(step, torch.device("cpu"))
    received = wire.STEPS.decode(wire.encode(header))
    buffers = received.buffers(torch.device("cpu"))
    assert [b.shape for b in buffers] == [t.shape for t in tensors]
    for buffer, tensor in zip(buffers, tensors):
        buffer.copy_(tensor)
    got = received.step(buffers)
    assert (got.token_ids, got.start_positions, got.block_tables, got.num_logits, got.from_device) == (
        [[5, 0, 0], [9]], [4, 17], [[0, 1], [2, 3]], [2, 1], [(1, 1), (2, 0)] if with_tensors else [])
    assert got.block_copies == ([(7, 1, 3)] if with_tensors else [])
    for name in ("device_tokens", "position_offsets"):
        sent, came = getattr(step, name), getattr(got, name)
        assert (came is None) if sent is None else torch.equal(came, sent)


def test_stop_is_none_and_an_inconsistent_step_is_refused():
    assert wire.STEPS.decode(wire.encode(None)) is None
    header, _ = StepHeader.of(_step(False), torch.device("cpu"))
    assert wire.encode(header)[-2:] == b"\xc2\x90"  # has_position_offsets false, no block copies
    bad = wire.encode(header)[:-2] + b"\x05\x90"  # has_position_offsets: 5, not a bool
    with pytest.raises(WireError, match="not a step"):
        wire.STEPS.decode(bad)
    lists = [[[1]], [0, 1], [[0]], [1], [], None, False, []]  # two start positions for one request
    with pytest.raises(WireError, match="differ in length"):
        wire.STEPS.decode(wire.encode(lists))
    lists = [[[1]], [0], [[0]], [1], [], None, False, [[-1, 2, 3]]]  # a block id out of range
    with pytest.raises(WireError, match="block_copies"):
        wire.STEPS.decode(wire.encode(lists))
