"""Cancelling a stream aborts the request in the engine and gives its KV blocks back."""
from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from client.stream import generate
from tests.server.conftest import idle

pytestmark = pytest.mark.server

ABORTED = 'specserve_request_success_total{finish_reason="abort"}'
LENGTH = 'specserve_request_success_total{finish_reason="length"}'
ABORT_KEY = "k3y-of-the-sender-0123456789"  # what the sender attached to the request it may stop


def _long_request_tokens(server, tokenizer) -> tuple[list[int], int]:
    prompt_ids = tokenizer("Once upon a time")["input_ids"]
    max_tokens = min(4000, _max_model_len(server) - len(prompt_ids))
    return prompt_ids, max_tokens


def _max_model_len(server) -> int:
    config = json.loads((server.model_dir / "config.json").read_text())
    return config["max_position_embeddings"]


def _tensor(name, array, datatype):
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _streaming_engine_inputs(prompt_ids: list[int], max_tokens: int) -> list:
    """llm_engine inputs of a greedy streamed request that ignores EOS."""
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return [
        _tensor("input_ids", np.array(prompt_ids, dtype=np.int32), "INT32"),
        _tensor("sampling_params", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES"),
        _tensor("request_options", np.array([b'{"stream": true}'], dtype=np.object_), "BYTES"),
    ]


def test_cancelling_an_engine_stream_frees_its_blocks(server, tokenizer):
    """Straight to llm_engine (token ids in): a closed stream aborts the request at once."""
    prompt_ids, max_tokens = _long_request_tokens(server, tokenizer)
    before = server.wait_for_metrics(idle)
    inputs = _streaming_engine_inputs(prompt_ids, max_tokens)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("llm_engine", inputs, enable_empty_final_response=True)
    for _ in range(3):
        result, error = responses.get(timeout=120)
        assert error is None
    during = server.wait_for_metrics(lambda s: s["specserve_num_requests_running"] == 1)  # gauges lag a poll
    assert during["specserve_num_requests_running"] == 1
    assert during["specserve_kv_cache_free_blocks"] < during["specserve_kv_cache_total_blocks"]
    client.stop_stream(cancel_requests=True)
    client.close()

    after = server.wait_for_metrics(lambda s: idle(s) and s[ABORTED] > before[ABORTED])
    assert after[ABORTED] == before[ABORTED] + 1
    assert after[LENGTH] == before[LENGTH]  # it did not run to max_tokens
    assert after["specserve_generation_tokens_total"] - before["specserve_generation_tokens_total"] < max_tokens
    assert idle(after)


def test_cancelling_many_engine_streams_aborts_every_one(server, tokenizer):
    """More requests than one cancellation poll checks: polls take turns until all are found."""
    prompt_ids, max_tokens = _long_request_tokens(server, tokenizer)
    before = server.wait_for_metrics(idle)
    inputs = _streaming_engine_inputs(prompt_ids, max_tokens)
    num_requests = 40
    started: set[str] = set()
    first_tokens: queue.SimpleQueue = queue.SimpleQueue()  # request id, or the error before any cancel

    def on_response(result, error):
        if error is not None:  # expected once the stream is cancelled
            first_tokens.put(error)
            return
        request_id = result.get_response().id
        if request_id not in started:
            started.add(request_id)
            first_tokens.put(request_id)

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=on_response)
    for i in range(num_requests):
        client.async_stream_infer("llm_engine", inputs, request_id=f"many-{i}", enable_empty_final_response=True)
    for _ in range(num_requests):
        assert isinstance(first_tokens.get(timeout=120), str)
    client.stop_stream(cancel_requests=True)
    client.close()

    after = server.wait_for_metrics(lambda s: idle(s) and s[ABORTED] >= before[ABORTED] + num_requests)
    assert after[ABORTED] == before[ABORTED] + num_requests
    assert after[LENGTH] == before[LENGTH]


def test_server_serves_after_a_cancel(server):
    chunks = generate(server.grpc_url, "Once upon a time", model="llm_bls", max_tokens=200, ignore_eos=True,
                      temperature=0)
    next(chunks)
    chunks.close()  # cancels
    server.wait_for_metrics(idle)
    result = list(generate(server.grpc_url, "Hello", max_tokens=5, ignore_eos=True, temperature=0,
                           return_num_output_tokens=True))
    assert sum(c.num_output_tokens for c in result) == 5


def test_cancelling_an_llm_bls_stream_aborts_the_engine_request(server, tokenizer):
    """Through `llm_bls` (text in): a closed stream reaches llm_engine as an abort at once."""
    _, max_tokens = _long_request_tokens(server, tokenizer)
    before = server.wait_for_metrics(idle)
    chunks = generate(
        server.grpc_url, "Once upon a time", model="llm_bls", max_tokens=max_tokens, ignore_eos=True,
        temperature=0,
    )
    for _ in range(3):
        next(chunks)
    during = server.wait_for_metrics(lambda s: s["specserve_num_requests_running"] == 1)  # gauges lag a poll
    assert during["specserve_num_requests_running"] == 1
    assert during["specserve_kv_cache_free_blocks"] < during["specserve_kv_cache_total_blocks"]
    chunks.close()

    after = server.wait_for_metrics(lambda s: idle(s) and s[ABORTED] > before[ABORTED], timeout=5)
    assert idle(after)
    assert after[ABORTED] == before[ABORTED] + 1
    assert after[LENGTH] == before[LENGTH]
    assert after["specserve_generation_tokens_total"] - before["specserve_generation_tokens_total"] < max_tokens


def test_abort_request_id_aborts_the_engine_request_sent_with_that_id(server, tokenizer):
    """llm_engine's control input: the named request ends at once, the control request with one
    empty final response."""
    prompt_ids, max_tokens = _long_request_tokens(server, tokenizer)
    before = server.wait_for_metrics(idle)
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    options = {"stream": True, "return_finish_reason": True}
    inputs = [
        _tensor("input_ids", np.array(prompt_ids, dtype=np.int32), "INT32"),
        _tensor("sampling_params", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES"),
        _tensor("request_options", np.array([json.dumps(options).encode()], dtype=np.object_), "BYTES"),
        _tensor("abort_key", np.array([ABORT_KEY.encode()], dtype=np.object_), "BYTES"),
    ]
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("llm_engine", inputs, request_id="to-abort", enable_empty_final_response=True)
    result, error = responses.get(timeout=120)
    assert error is None

    control = [_tensor("abort_request_id", np.array([b"to-abort"], dtype=np.object_), "BYTES"),
               _tensor("abort_key", np.array([ABORT_KEY.encode()], dtype=np.object_), "BYTES")]
    control_responses = []
    control_client = grpcclient.InferenceServerClient(server.grpc_url)
    control_client.start_stream(callback=lambda result, error: control_responses.append((result, error)))
    control_client.async_stream_infer("llm_engine", control, enable_empty_final_response=True)
    control_client.stop_stream()  # waits for the control request's responses
    control_client.close()
    [(result, error)] = control_responses
    assert error is None
    assert result.get_response().parameters["triton_final_response"].bool_param
    assert result.as_numpy("text_output") is None

    while True:  # the aborted request ends with its finish reason
        result, error = responses.get(timeout=5)
        assert error is None
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    assert result.as_numpy("finish_reason").tolist() == [b"abort"]
    after = server.wait_for_metrics(lambda s: idle(s) and s[ABORTED] > before[ABORTED], timeout=5)
    assert after[ABORTED] == before[ABORTED] + 1
    assert idle(after)


def test_a_cancelled_llm_stream_without_a_stop_request_runs_to_the_end(server, tokenizer):
    """What a raw tritonclient user sees on tritonserver 2.51: cancelling a stream to the `llm`
    ensemble is checked only between its steps, and nothing tells llm_engine (its response sender
    reports no cancellation), so the request runs to max_tokens. A stop request ends it (below)."""
    max_tokens = 48
    before = server.wait_for_metrics(idle)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    prompt = _tensor("text_input", np.array([b"Once upon a time"], dtype=np.object_), "BYTES")
    options = [_tensor("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
               _tensor("ignore_eos", np.array([True]), "BOOL"), _tensor("stream", np.array([True]), "BOOL")]
    client.async_stream_infer("llm", [prompt, *options], request_id="no-stop-request")
    responses.get(timeout=60)
    client.stop_stream(cancel_requests=True)
    client.close()
    after = server.wait_for_metrics(
        lambda s: idle(s) and s[ABORTED] + s[LENGTH] > before[ABORTED] + before[LENGTH], 120
    )
    assert after[LENGTH] == before[LENGTH] + 1
    assert after[ABORTED] == before[ABORTED]


def _long_llm_request(server) -> dict:
    return dict(max_tokens=min(1500, _max_model_len(server) - 16), ignore_eos=True, temperature=0)


def _stopped_within_a_second(server, before: dict[str, float]) -> None:
    after = server.wait_for_metrics(lambda s: idle(s) and s[ABORTED] > before[ABORTED], timeout=1.0)
    assert idle(after), after
    assert after[ABORTED] == before[ABORTED] + 1


def test_a_stop_request_to_llm_frees_the_requests_kv(server):
    """The convention: a request to `llm` with only `abort_request_id`, naming the request to stop."""
    before = server.wait_for_metrics(idle)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    prompt = _tensor("text_input", np.array([b"Once upon a time"], dtype=np.object_), "BYTES")
    params = _long_llm_request(server)
    options = [_tensor("max_tokens", np.array([params["max_tokens"]], dtype=np.int32), "INT32"),
               _tensor("ignore_eos", np.array([True]), "BOOL"), _tensor("stream", np.array([True]), "BOOL")]
    key = _tensor("abort_key", np.array([ABORT_KEY.encode()], dtype=np.object_), "BYTES")
    client.async_stream_infer("llm", [prompt, *options, key], request_id="to-stop", enable_empty_final_response=True)
    for _ in range(3):
        result, error = responses.get(timeout=60)
        assert error is None
    stop = _tensor("abort_request_id", np.array([b"to-stop"], dtype=np.object_), "BYTES")
    client.async_stream_infer("llm", [stop, key], request_id="stop", enable_empty_final_response=True)
    ended = set()
    while ended != {"to-stop", "stop"}:
        result, error = responses.get(timeout=10)
        assert error is None
        response = result.get_response()
        if response.parameters["triton_final_response"].bool_param:
            ended.add(response.id)
    client.stop_stream()
    client.close()
    _stopped_within_a_second(server, before)


def _stop_from(server, request_id: bytes, key: bytes | None):
    """A stop request for `request_id` sent by another client; (result, error) of its answer."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    stop = [_tensor("abort_request_id", np.array([request_id], dtype=np.object_), "BYTES")]
    if key is not None:
        stop.append(_tensor("abort_key", np.array([key], dtype=np.object_), "BYTES"))
    client.async_stream_infer("llm", stop, enable_empty_final_response=True)
    answer = answers.get(timeout=10)
    client.stop_stream()
    client.close()
    return answer


def test_a_stop_from_another_client_leaves_the_stream_running_to_its_end(server):
    """The attack: a client that knows (or guesses) another's request id sends stops for it, with
    no key and with a wrong one. The first is refused naming abort_key; neither ends the request,
    which runs to max_tokens."""
    before = server.wait_for_metrics(idle)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    max_tokens = 24
    inputs = [_tensor("text_input", np.array([b"Once upon a time"], dtype=np.object_), "BYTES"),
              _tensor("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
              _tensor("ignore_eos", np.array([True]), "BOOL"), _tensor("stream", np.array([True]), "BOOL"),
              _tensor("return_num_output_tokens", np.array([True]), "BOOL"),
              _tensor("return_finish_reason", np.array([True]), "BOOL"),
              _tensor("abort_key", np.array([ABORT_KEY.encode()], dtype=np.object_), "BYTES")]
    client.async_stream_infer("llm", inputs, request_id="victim", enable_empty_final_response=True)
    first, error = responses.get(timeout=60)
    assert error is None

    _, error = _stop_from(server, b"victim", None)
    assert error is not None and "abort_key" in error.message() and "required" in error.message()
    _, error = _stop_from(server, b"victim", b"not-the-senders-key-0123")
    assert error is None  # a stop is answered alike whether it matched or not

    result, tokens = first, 0
    while True:
        counted = result.as_numpy("num_output_tokens")
        tokens += int(counted.reshape(-1)[0]) if counted is not None and counted.size else 0
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
        result, error = responses.get(timeout=60)
        assert error is None
    client.stop_stream()
    client.close()
    assert result.as_numpy("finish_reason").tolist() == [b"length"]
    assert tokens == max_tokens
    after = server.wait_for_metrics(lambda s: idle(s) and s[LENGTH] > before[LENGTH], timeout=10)
    assert after[LENGTH] == before[LENGTH] + 1
    assert after[ABORTED] == before[ABORTED]


def test_a_malformed_abort_key_is_refused_naming_it(server):
    result, error = _stop_from(server, b"any", b"short")
    assert error is not None and "abort_key: must be 16 to 128" in error.message()
    assert server.handle.is_ready()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_leaving_an_llm_stream_early_stops_the_request(server, protocol):
    """The client library sends the stop request when a stream is left early."""
    before = server.wait_for_metrics(idle)
    url = server.grpc_url if protocol == "grpc" else server.http_url
    chunks = generate(url, "Once upon a time", protocol=protocol, model="llm", **_long_llm_request(server))
    for _ in range(3):
        next(chunks)
    chunks.close()
    _stopped_within_a_second(server, before)


def _as_a_shell_starts_it() -> None:
    """SIGINT at its default and not blocked, as a shell starts a command: a child inherits the
    disposition and the mask of the process that starts it, and after the model tests the test
    process has SIGINT ignored (set by a library they use), where Python installs no Ctrl-C handler."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_the_cli_stops_the_request(server):
    before = server.wait_for_metrics(idle)
    params = _long_llm_request(server)
    cli = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-m", "client.cli", "Once upon a time", "--url", server.grpc_url,
         "--max-tokens", str(params["max_tokens"]), "--ignore-eos", "--temperature", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parents[2],
        preexec_fn=_as_a_shell_starts_it,
    )
    try:
        assert cli.stdout.read(8)  # it is streaming
        cli.send_signal(signal.SIGINT)
        try:
            code = cli.wait(timeout=10)
        except subprocess.TimeoutExpired:
            cli.send_signal(signal.SIGABRT)  # faulthandler prints where every thread is
            cli.wait(timeout=10)
            code = None
        assert code == 130, cli.stderr.read().decode(errors="replace")[-6000:]
    finally:
        cli.kill()
    _stopped_within_a_second(server, before)
