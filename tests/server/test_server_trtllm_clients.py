"""TensorRT-LLM backend's clients against the `ensemble` model: the request logic of its
end_to_end_grpc_client.py (inputs as a batch of one, [[value]], read back as it reads them) and
its README's curl example, re-implemented here; the features of beams and logits refused by name."""
from __future__ import annotations

import json
import queue
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from client.stream import complete

pytestmark = pytest.mark.server

PROMPT = "def fibonacci(n):"


def _inputs(stream: bool, output_len: int = 12, beam_width: int = 1, exclude_input_in_output: bool = False,
            **extra) -> list:
    """What end_to_end_grpc_client.prepare_inputs sends: every value as [[value]],
    exclude_input_in_output always (its --exclude-input-in-output flag, false unless given)."""
    values = {
        "text_input": np.array([[PROMPT]]).astype(object),
        "max_tokens": np.ones((1, 1), dtype=np.int32) * output_len,
        "stream": np.array([[stream]], dtype=bool),
        "beam_width": np.array([[beam_width]], dtype=np.int32),
        "temperature": np.array([[1.0]], dtype=np.float32),
        "exclude_input_in_output": np.array([[exclude_input_in_output]], dtype=bool),
    } | extra
    return tensors(values)


def tensors(values: dict[str, np.ndarray]) -> list:
    """gRPC inputs of these names and arrays, in their shapes and types."""
    out = []
    for name, value in values.items():
        tensor = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        out.append(tensor)
    return out


def run_ensemble(server, inputs) -> list:
    """Start a stream, send, stop_stream() (waits for the end), then read the results: the
    client's run_inference."""
    results: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error or result))
    client.async_stream_infer("ensemble", inputs, request_id="")
    client.stop_stream()
    client.close()
    out = []
    while not results.empty():
        out.append(results.get())
    return out


def _greedy(**extra) -> dict:
    return {"top_k": np.array([[1]], dtype=np.int32), "random_seed": np.array([[5]], dtype=np.uint64)} | extra


@pytest.mark.parametrize("exclude_input_in_output", [None, False, True])
@pytest.mark.parametrize("stream", [True, False])
def test_the_end_to_end_client_in_both_modes(server, stream, exclude_input_in_output):
    """What run_inference reads, and its --check-outputs rule. Streamed, TensorRT-LLM's executor
    starts after the prompt whatever exclude_input_in_output says: the first response holds the
    first generated tokens' text, each response only its new text, which the client appends. Whole,
    one response: the prompt, then the completion, unless excluded. text_output is [1] (one string
    per request), batch_index [1, 1] (0: the first of a batch of one)."""
    extra = {} if exclude_input_in_output is None else {"exclude_input_in_output": exclude_input_in_output}
    results = run_ensemble(server, _inputs(stream, **extra, **_greedy()))
    assert not [r for r in results if isinstance(r, InferenceServerException)]
    assert all(r.as_numpy("text_output").shape == (1,) and r.as_numpy("batch_index").tolist() == [[0]]
               for r in results)
    texts = [r.as_numpy("text_output")[0].decode("utf-8") for r in results]
    completion = complete(server.grpc_url, PROMPT, max_tokens=12, top_k=1, seed=5).text
    if stream:
        assert len(texts) > 1 and all(texts[:-1]) and completion.startswith(texts[0])
        assert "".join(texts) == completion
    else:
        assert texts == [completion if exclude_input_in_output else PROMPT + completion]


def test_log_probs_min_length_and_end_id(server, tokenizer):
    extra = _greedy(return_log_probs=np.array([[True]]), min_length=np.array([[12]], dtype=np.int32),
                    end_id=np.array([[tokenizer.eos_token_id]], dtype=np.int32),
                    pad_id=np.array([[0]], dtype=np.int32),
                    stop_words=np.array([[""]], dtype=object), bad_words=np.array([[""]], dtype=object))
    [result] = run_ensemble(server, _inputs(False, **extra))
    log_probs = result.as_numpy("output_log_probs")
    assert log_probs.shape == (1, 12) and (log_probs <= 0).all()  # min_length: all 12 tokens
    assert result.as_numpy("cum_log_probs")[0] == pytest.approx(float(log_probs.sum()), abs=1e-3)


@pytest.mark.parametrize("name,value", [
    ("beam_width", None), ("length_penalty", np.array([[0.5]], dtype=np.float32)),
    ("bad_words", np.array([["fibonacci"]], dtype=object)), ("return_generation_logits", np.array([[True]])),
])
def test_beams_and_logits_are_refused_by_name(server, name, value):
    inputs = _inputs(False, beam_width=2) if name == "beam_width" else _inputs(False, **{name: value})
    [error] = run_ensemble(server, inputs)
    assert isinstance(error, InferenceServerException)
    assert f"{name}: " in error.message()


def test_the_readme_curl_example(server):
    body = {"text_input": "What is machine learning?", "max_tokens": 20, "bad_words": "", "stop_words": ""}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert answer["text_output"].startswith("What is machine learning?")
