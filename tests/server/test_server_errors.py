"""Bad input gets INVALID_ARG (HTTP 400) naming the field; the server stays up and serves on."""
from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.stream import GenerationError, complete

pytestmark = pytest.mark.server

# (request inputs, text the error must contain)
BAD_REQUESTS = {
    "max_tokens_zero": (dict(max_tokens=0), "max_tokens"),
    "max_tokens_past_context": (dict(max_tokens=10**6), "max_tokens"),
    "temperature_negative": (dict(temperature=-0.5), "temperature"),
    "top_p_zero": (dict(top_p=0.0), "top_p"),
    "top_p_above_one": (dict(top_p=1.5), "top_p"),
    "top_k_negative": (dict(top_k=-2), "top_k"),
    "min_p_above_one": (dict(min_p=1.5), "min_p"),
    "repetition_penalty_zero": (dict(repetition_penalty=0.0), "repetition_penalty"),
    "presence_penalty_too_big": (dict(presence_penalty=3.0), "presence_penalty"),
    "frequency_penalty_too_small": (dict(frequency_penalty=-3.0), "frequency_penalty"),
    "min_tokens_negative": (dict(min_tokens=-1), "min_tokens"),
    "min_tokens_above_max_tokens": (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    "stop_empty_string": (dict(stop=[""]), "stop"),
    "sampling_parameters_malformed": (dict(sampling_parameters='{"temperature": 0.5,'), "malformed JSON"),
    "sampling_parameters_not_object": (dict(sampling_parameters="[1, 2]"), "sampling_parameters"),
    "sampling_parameters_unknown_key": (dict(sampling_parameters='{"beams": 4}'), "beams"),
    "sampling_parameters_bad_value": (dict(sampling_parameters='{"temperature": "hot"}'), "temperature"),
    "input_and_json_disagree": (
        dict(temperature=0.5, sampling_parameters='{"temperature": 0.7}'), "temperature"
    ),
    "empty_prompt": (dict(text_input=""), "empty prompt"),
    "no_prompt": (dict(text_input=None), "text_input"),
    "prompt_and_messages": (dict(messages='[{"role": "user", "content": "hi"}]'), "not both"),
    "messages_malformed": (dict(text_input=None, messages="[{"), "messages"),
    "messages_not_chat": (dict(text_input=None, messages='[{"role": "user"}]'), "messages"),
    "prompt_too_long": (dict(text_input="word " * 20000), "text_input"),
}


def _request(server, protocol: str, **inputs):
    inputs = {"text_input": "Once upon a time", "max_tokens": 4, **inputs}
    prompt = inputs.pop("text_input")
    url = server.grpc_url if protocol == "grpc" else server.http_url
    stream = protocol == "grpc"
    return complete(url, prompt, protocol=protocol, stream=stream, timeout=120, **inputs)


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_input_is_invalid_arg_naming_the_field(server, name):
    inputs, expected = BAD_REQUESTS[name]
    with pytest.raises(GenerationError) as http_error:
        _request(server, "http", **inputs)
    assert http_error.value.status == "400"  # Triton's INVALID_ARG
    assert expected in str(http_error.value)
    with pytest.raises(GenerationError) as grpc_error:  # a stream error carries the message only
        _request(server, "grpc", **inputs)
    assert expected in str(grpc_error.value)


def test_range_is_in_the_message(server):
    with pytest.raises(GenerationError, match=r"top_p: must be in \(0.0, 1.0\], got 1.5"):
        _request(server, "http", top_p=1.5)


def test_llm_bls_gives_the_same_error(server):
    with pytest.raises(GenerationError, match=r"^top_p: must be in \(0.0, 1.0\], got 1.5"):
        complete(server.grpc_url, "hi", model="llm_bls", top_p=1.5)


def _grpc_infer(server, model: str, inputs: list) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    errors = []
    client.start_stream(callback=lambda result, error: errors.append(error))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    finally:
        client.stop_stream()
    if errors and errors[0] is not None:
        raise errors[0]


def _tensor(name, array, datatype):
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_wrong_dtype_is_refused_by_triton(server):
    inputs = [
        _tensor("text_input", np.array([b"hi"], dtype=np.object_), "BYTES"),
        _tensor("max_tokens", np.array([1.5], dtype=np.float32), "FP32"),
    ]
    with pytest.raises(InferenceServerException, match="max_tokens.*FP32.*INT32"):
        _grpc_infer(server, "llm", inputs)


def test_unknown_input_is_refused_by_triton(server):
    inputs = [
        _tensor("text_input", np.array([b"hi"], dtype=np.object_), "BYTES"),
        _tensor("beam_width", np.array([2], dtype=np.int32), "INT32"),
    ]
    with pytest.raises(InferenceServerException, match="beam_width"):
        _grpc_infer(server, "llm", inputs)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_unknown_model(server, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    with pytest.raises(GenerationError, match="nope"):
        complete(url, "hi", protocol=protocol, model="nope", max_tokens=2)


def test_bad_engine_request_gets_invalid_arg(server):
    """llm_engine checks what preprocessing would have: token ids out of the vocabulary."""
    inputs = [
        _tensor("input_ids", np.array([1, 10**8], dtype=np.int32), "INT32"),
        _tensor("sampling_params", np.array([json.dumps({"max_tokens": 2}).encode()], dtype=np.object_), "BYTES"),
    ]
    with pytest.raises(InferenceServerException, match="input_ids"):
        _grpc_infer(server, "llm_engine", inputs)


def test_engine_request_without_input_ids_gets_invalid_arg(server):
    """input_ids is optional in llm_engine's config only for requests with abort_request_id."""
    params = np.array([json.dumps({"max_tokens": 2}).encode()], dtype=np.object_)
    with pytest.raises(InferenceServerException, match="input_ids: required"):
        _grpc_infer(server, "llm_engine", [_tensor("sampling_params", params, "BYTES")])


def test_server_is_ready_and_serves_after_errors(server):
    for inputs, _ in BAD_REQUESTS.values():
        with pytest.raises(GenerationError):
            _request(server, "grpc", **inputs)
    assert server.handle.is_ready()
    result = _request(server, "grpc", max_tokens=6, ignore_eos=True, return_num_output_tokens=True)
    assert result.num_output_tokens == 6
