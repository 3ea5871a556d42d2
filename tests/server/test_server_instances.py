"""Several llm_engine instances (instance_group count 2) with back-pressure: both serve, each
output equals its solo run, metrics carry the instance, stop requests reach whichever instance
holds a request, Triton's queue policy applies, and one instance's failed engine leaves the other
serving."""
from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from client.stream import GenerationError, complete, generate
from tests.server.conftest import idle, start_test_server

pytestmark = pytest.mark.server

FATAL_SEED = 777  # a request with this seed kills its instance's engine after two tokens
TWO_INSTANCES = "instance_group [ { count: 2, kind: KIND_CPU } ]"
SUCCESS = "specserve_request_success_total"
PROMPTS = [f"Story {i}: once upon a time" for i in range(32)]


@pytest.fixture(scope="module")
def two_instances(tmp_path_factory):
    server = start_test_server(tmp_path_factory.mktemp("instances"), f"fatal_seed={FATAL_SEED}",
                               {"max_pending_requests": "2"}, TWO_INSTANCES)
    yield server
    server.handle.stop()


def _finished(samples: dict[str, float]) -> float:
    return sum(v for k, v in samples.items() if k.startswith(SUCCESS))


def _greedy(server, prompt: str) -> str:
    return complete(server.grpc_url, prompt, max_tokens=24, temperature=0, ignore_eos=True).text


def test_both_instances_serve_and_each_output_equals_its_solo_run(two_instances):
    solo = [_greedy(two_instances, p) for p in PROMPTS[:4]]
    before = two_instances.instance_metrics()
    assert len(before) == 2  # one set of metrics per instance
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda p: _greedy(two_instances, p), PROMPTS))
    assert together[:4] == solo
    assert all(together)
    after = two_instances.instance_metrics()
    served = {name: _finished(after[name]) - _finished(before[name]) for name in after}
    assert sum(served.values()) == len(PROMPTS)
    assert all(n > 0 for n in served.values()), served


def test_stopping_streams_frees_the_kv_of_both_instances(two_instances):
    before = two_instances.wait_for_metrics(idle)
    streams = [generate(two_instances.grpc_url, p, max_tokens=1000, ignore_eos=True, temperature=0)
               for p in PROMPTS[:6]]
    for stream in streams:
        next(stream)
    running = {name: m["specserve_num_requests_running"] for name, m in two_instances.instance_metrics().items()}
    assert all(n > 0 for n in running.values()), running
    for stream in streams:
        stream.close()  # sends the stop request
    after = two_instances.wait_for_metrics(idle, timeout=1.0)
    assert idle(after)
    assert after[f'{SUCCESS}{{finish_reason="abort"}}'] == before[f'{SUCCESS}{{finish_reason="abort"}}'] + 6


def test_a_stop_request_that_overtakes_its_request_aborts_it_on_arrival(two_instances):
    """Sent first, the stop is remembered by every instance, whichever one the request reaches
    (with the same abort key: the request is ended on arrival)."""
    client = grpcclient.InferenceServerClient(two_instances.grpc_url)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    stop = grpcclient.InferInput("abort_request_id", [1], "BYTES")
    stop.set_data_from_numpy(np.array([b"early"], dtype=np.object_))
    key = grpcclient.InferInput("abort_key", [1], "BYTES")
    key.set_data_from_numpy(np.array([b"the-early-stop-key-0123"], dtype=np.object_))
    client.async_stream_infer("llm", [stop, key], request_id="stop", enable_empty_final_response=True)
    assert responses.get(timeout=10)[1] is None
    prompt = grpcclient.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"Once upon a time"], dtype=np.object_))
    client.async_stream_infer("llm", [prompt, key], request_id="early", enable_empty_final_response=True)
    result, error = responses.get(timeout=10)
    assert error is None
    assert result.get_response().parameters["triton_final_response"].bool_param
    assert result.as_numpy("text_output") is None  # ended before any token
    client.stop_stream()
    client.close()


def test_one_instance_failing_leaves_the_other_serving(two_instances):
    with pytest.raises(GenerationError):
        complete(two_instances.grpc_url, "This request kills its engine", max_tokens=32, seed=FATAL_SEED,
                 temperature=0.5, ignore_eos=True)
    served = 0
    for prompt in PROMPTS[:8]:
        try:
            served += bool(_greedy(two_instances, prompt))
        except GenerationError as e:
            assert "unavailable" in str(e)  # handed to the failed instance: retry
    assert served >= 4
    assert len([1 for p in PROMPTS[:8] if _retrying(two_instances, p)]) == 8


def _retrying(server, prompt: str, attempts: int = 5) -> str:
    for _ in range(attempts):
        try:
            return _greedy(server, prompt)
        except GenerationError as e:
            if "unavailable" not in str(e):
                raise
    raise AssertionError(f"{prompt!r} failed {attempts} times")


def test_a_full_triton_queue_refuses_with_unavailable(tmp_path_factory):
    """With back-pressure, Triton's queue policy applies: max_queue_size 1 and a slow instance
    that takes one pending request at a time refuse the overflow (UNAVAILABLE) at once."""
    server = start_test_server(
        tmp_path_factory.mktemp("queue"), "", {"max_pending_requests": "1", "max_num_seqs": "1"},
        "instance_group [ { count: 1, kind: KIND_CPU } ]\n"
        "dynamic_batching { default_queue_policy { max_queue_size: 1 } }",
    )
    try:
        def attempt(prompt: str) -> str:
            try:
                complete(server.grpc_url, prompt, max_tokens=16, temperature=0, ignore_eos=True)
                return "ok"
            except GenerationError as e:
                return str(e).split("] ")[-1]  # without the request id

        with ThreadPoolExecutor(12) as pool:
            outcomes = list(pool.map(attempt, PROMPTS[:12]))
        # Triton's UNAVAILABLE; a stream's error (and generate's, always 400) carries no code
        assert set(outcomes) == {"ok", "Exceeds maximum queue size"}, outcomes
        assert _greedy(server, PROMPTS[0])  # and it serves on
    finally:
        server.handle.stop()
