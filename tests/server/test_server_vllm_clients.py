"""vllm_backend's clients against `llm`: the request logic of vllm_backend's additional-outputs CI
test (ci/L0_additional_outputs_vllm), re-implemented here with its published expectations.

Each case streams or not, sends the sampling parameters both as the `sampling_parameters` tensor and
as Triton request parameters (as that test does), and sets each of return_finish_reason,
return_cumulative_logprob, return_logprobs, return_num_input_tokens and return_num_output_tokens
to absent, true or false, with the sampling parameter `logprobs` absent, 0 or 2: 2 * 3^6 = 1,458
cases. They run against the tiny test model and against the default model; CI runs every 18th
case on the first (81) and every 54th on the second (27); SPECSERVE_ALL_VLLM_CASES=1 runs them all.

The cases that depend on the base model are those with return_finish_reason true (486 of 1,458):
that test expects the last response's finish_reason to be "length", i.e. every greedy answer to
"In this example," to run to max_tokens (16, vLLM's default), as its base model (facebook/opt-125m)
does, and as the tiny test model does. The default model, an instruct model, ends its answer at
its EOS first, so its finish_reason is "stop"; these cases expect that here. Every other case
expects what that test does, on both models.

What vllm_backend does and these check: finish_reason is "None" on every response but the last;
cumulative_logprob changes with every response; logprobs is null without the sampling parameter
`logprobs`, else per token {id: {"logprob", "rank", "decoded_token"}} (the chosen token ranked 1,
at most logprobs + 1 entries), one per token the response carries, the rank-1 tokens spelling the
response's text (after the prompt, which a whole completion repeats); num_input_tokens is at most
the prompt's characters; num_output_tokens counts the response's own tokens; an output not asked
for is absent.
"""
from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.server.conftest import DEFAULT_MODEL

pytestmark = pytest.mark.server

PROMPT = "In this example,"
FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
         "return_num_output_tokens")
CASES = [
    (stream, logprobs, dict(zip(FLAGS, flags)))
    for stream, logprobs, *flags in itertools.product(
        [True, False], [None, 0, 2], *[[None, True, False]] * len(FLAGS)
    )
]
ALL_CASES = bool(os.environ.get("SPECSERVE_ALL_VLLM_CASES"))
# the server fixture -> the finish reason its greedy answer to PROMPT ends with
FINISH_REASONS = {"server": "length", "smol_server": "stop"}
NOT_CONVERTED = pytest.mark.skipif(not (DEFAULT_MODEL / "conversion.json").is_file(),
                                   reason="run python -m scripts.convert_default_model (make test does)")
SERVED_CASES = [pytest.param("server", *case) for case in (CASES if ALL_CASES else CASES[::18])] + [
    pytest.param("smol_server", *case, marks=NOT_CONVERTED) for case in (CASES if ALL_CASES else CASES[10::54])
]


def _tensor(name: str, value, datatype: str) -> grpcclient.InferInput:
    array = np.array([value], dtype=np.object_ if datatype == "BYTES" else bool)
    tensor = grpcclient.InferInput(name, [1], datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _infer(server, stream: bool, sampling_parameters: dict, flags: dict) -> list:
    inputs = [_tensor("text_input", PROMPT.encode(), "BYTES"), _tensor("stream", stream, "BOOL"),
              _tensor("sampling_parameters", json.dumps(sampling_parameters).encode(), "BYTES")]
    inputs += [_tensor(name, value, "BOOL") for name, value in flags.items() if value is not None]
    responses = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(lambda result, error: responses.append((result, error)))
        client.async_stream_infer("llm", inputs=inputs, parameters=sampling_parameters)
        client.stop_stream()
    assert responses
    assert all(error is None for _, error in responses), [str(e) for _, e in responses if e]
    return [result for result, _ in responses]


def _absent_unless(results, name: str, flag) -> bool:
    """True when the output should be checked; else it must be absent from every response."""
    if flag:
        return True
    assert all(r.as_numpy(name) is None for r in results)
    return False


@pytest.mark.parametrize("served,stream,logprobs,flags", SERVED_CASES)
def test_additional_outputs(request, served, stream, logprobs, flags):
    server = request.getfixturevalue(served)
    sampling_parameters = {"temperature": "0", "top_p": "1"} | ({} if logprobs is None else {"logprobs": logprobs})
    results = _infer(server, stream, sampling_parameters, flags)
    texts = [r.as_numpy("text_output")[0].decode() for r in results]
    assert "".join(texts).count(" ") > 4  # a sentence
    if _absent_unless(results, "finish_reason", flags["return_finish_reason"]):
        reasons = [r.as_numpy("finish_reason")[0].decode() for r in results]
        assert reasons == ["None"] * (len(results) - 1) + [FINISH_REASONS[served]]
    if _absent_unless(results, "cumulative_logprob", flags["return_cumulative_logprob"]):
        values = [0.0] + [float(r.as_numpy("cumulative_logprob")[0]) for r in results]
        assert all(a != b for a, b in zip(values, values[1:]))
    if _absent_unless(results, "logprobs", flags["return_logprobs"]):
        for result, text in zip(results, texts):
            entries = json.loads(result.as_numpy("logprobs")[0].decode())
            if logprobs is None:
                assert entries is None
                continue
            assert len(entries) >= 1
            if flags["return_num_output_tokens"]:
                assert len(entries) == int(result.as_numpy("num_output_tokens")[0])
            spelled = ""
            for entry in entries:
                assert 1 <= len(entry) <= logprobs + 1
                first = [d for d in entry.values() if d["rank"] == 1]
                assert len(first) == 1
                assert all(set(d) == {"logprob", "rank", "decoded_token"} and isinstance(d["logprob"], float)
                           and isinstance(d["rank"], int) and isinstance(d["decoded_token"], str)
                           for d in entry.values())
                spelled += first[0]["decoded_token"]
            assert (spelled if stream else PROMPT + spelled) == text
    if _absent_unless(results, "num_input_tokens", flags["return_num_input_tokens"]):
        assert all(0 < int(r.as_numpy("num_input_tokens")[0]) <= len(PROMPT) for r in results)
    if _absent_unless(results, "num_output_tokens", flags["return_num_output_tokens"]):
        assert all(int(r.as_numpy("num_output_tokens")[0]) > 0 for r in results)
