"""Property-based fuzzing of the request parser and SamplingParams, in-process: whatever a client
sends (any JSON in sampling_parameters and messages, any value of each typed input, integers past
64 bits, NaN and infinities, deep nesting, invalid UTF-8), the result is either a request whose
every field is valid or a ValidationError naming an input or a parameter; never another exception.
"""
from __future__ import annotations

import json
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.errors import ValidationError
from serving.triton import request_inputs
from backend.sampling_params import INT32_MAX, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, SamplingParams


MAX_PROMPT_BYTES = 4096
FIELDS = (
    set(request_inputs.SAMPLING_PARAMETER_KEYS)
    | set(request_inputs.SAMPLING_INPUTS)
    | {"text_input", "messages", "sampling_parameters"}
)
# the dtype each typed input has in llm's config.pbtxt (Triton enforces it)
TYPED_INPUTS = {
    "stream": np.bool_, "ignore_eos": np.bool_, "exclude_input_in_output": np.bool_,
    "return_finish_reason": np.bool_, "return_num_input_tokens": np.bool_,
    "return_num_output_tokens": np.bool_, "return_logprobs": np.bool_,
    "max_tokens": np.int32, "top_k": np.int32, "min_tokens": np.int32, "seed": np.uint64,
    "temperature": np.float32, "top_p": np.float32, "min_p": np.float32,
    "repetition_penalty": np.float32, "presence_penalty": np.float32, "frequency_penalty": np.float32,
}

numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-45, 1e-40, 1e-6, 1e-3, 5e-324, 1e308]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=12))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
sampling_parameters = st.one_of(
    st.dictionaries(st.sampled_from(request_inputs.SAMPLING_PARAMETER_KEYS), json_values, max_size=8),
    st.dictionaries(st.text(max_size=10), json_values, max_size=3),
    json_values,
)
nested = st.integers(min_value=1, max_value=200_000).map(lambda n: "[" * n + "]" * n)
json_text = st.one_of(
    sampling_parameters.map(json.dumps), nested, st.text(max_size=40), st.binary(max_size=40),
)
messages = st.one_of(
    st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=20)}),
        max_size=3,
    ).map(json.dumps),
    json_text,
)


def _bytes_array(value) -> np.ndarray:
    raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
    return np.array([raw], dtype=np.object_)


@st.composite
def requests(draw) -> dict[str, np.ndarray]:
    inputs: dict[str, np.ndarray] = {}
    prompt = draw(st.sampled_from(["text", "messages", "both", "neither"]))
    if prompt in ("text", "both"):
        inputs["text_input"] = _bytes_array(draw(st.one_of(st.text(max_size=30), st.binary(max_size=30))))
    if prompt in ("messages", "both"):
        inputs["messages"] = _bytes_array(draw(messages))
    if draw(st.booleans()):
        inputs["sampling_parameters"] = _bytes_array(draw(json_text))
    for name in draw(st.sets(st.sampled_from(sorted(TYPED_INPUTS)), max_size=6)):
        dtype = TYPED_INPUTS[name]
        shape = draw(st.sampled_from([(1,), (1,), (2,), (0,), (1, 1)]))
        if dtype is np.bool_:
            values = draw(st.lists(st.booleans(), min_size=1, max_size=2))
        elif dtype is np.float32:
            values = draw(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=2))
        else:
            info = np.iinfo(dtype)
            values = draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=1, max_size=2))
        size = int(np.prod(shape))
        inputs[name] = np.resize(np.array(values, dtype=dtype), size).reshape(shape)
    if draw(st.booleans()):
        stops = draw(st.lists(st.one_of(st.text(max_size=8), st.binary(max_size=8)), max_size=3))
        inputs["stop"] = np.array([s if isinstance(s, bytes) else s.encode("utf-8", "surrogatepass") for s in stops], dtype=np.object_)
    return inputs


def assert_valid(params: SamplingParams) -> None:
    """Every field in its documented range (what the engine relies on in a step)."""
    assert 1 <= params.max_tokens <= INT32_MAX and 0 <= params.min_tokens <= params.max_tokens
    assert params.temperature == 0.0 or 1e-2 <= params.temperature < math.inf
    assert 0.0 < params.top_p <= 1.0 and -1 <= params.top_k <= INT32_MAX and 0.0 <= params.min_p <= 1.0
    assert MIN_REPETITION_PENALTY <= params.repetition_penalty <= MAX_REPETITION_PENALTY
    assert all(-2.0 <= v <= 2.0 for v in (params.presence_penalty, params.frequency_penalty))
    assert params.seed is None or 0 <= params.seed < 2**64
    assert all(isinstance(t, int) and 0 <= t <= INT32_MAX for t in params.stop_token_ids)
    assert all(isinstance(s, str) and s for s in params.stop)
    assert isinstance(params.ignore_eos, bool) and isinstance(params.speculative, bool)
    assert SamplingParams.from_dict(json.loads(json.dumps(params.to_dict()))) == params


def assert_clean(error: ValidationError) -> None:
    assert error.field in FIELDS, error.field
    assert str(error).startswith(f"{error.field}: ")
    assert "Traceback" not in str(error) and len(str(error)) < 1000


def render_chat(messages: list[dict]) -> str:
    return "".join(f"<{m['role']}>{m['content']}" for m in messages)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_any_request_parses_or_is_a_validation_error(inputs):
    try:
        parsed = request_inputs.parse_request(inputs, render_chat, MAX_PROMPT_BYTES)
    except ValidationError as e:
        assert_clean(e)
        return
    assert_valid(parsed.params)
    assert 0 < len(parsed.prompt.encode("utf-8")) <= MAX_PROMPT_BYTES
    options = json.loads(parsed.options.to_json())
    assert all(isinstance(v, bool) for v in options.values())


@settings(max_examples=1000, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(SamplingParams.field_names())), json_values, max_size=8))
def test_any_sampling_params_dict_is_valid_or_a_validation_error(values):
    try:
        params = SamplingParams.from_dict(values)
    except ValidationError as e:
        assert_clean(e)
        return
    assert_valid(params)


def test_deep_nesting_is_refused_without_recursion():
    for name in ("sampling_parameters", "messages"):
        inputs = {"text_input": _bytes_array("hi")} if name == "sampling_parameters" else {}
        inputs[name] = _bytes_array("[" * 20_000 + "]" * 20_000)
        try:
            request_inputs.parse_request(inputs, render_chat, 10**7)
        except ValidationError as e:
            assert e.field == name and "nested deeper" in str(e)
        else:
            raise AssertionError("accepted")


def test_a_prompt_past_the_byte_bound_is_refused_before_anything_else():
    inputs = {"text_input": _bytes_array("x" * (MAX_PROMPT_BYTES + 1))}
    try:
        request_inputs.parse_request(inputs, render_chat, MAX_PROMPT_BYTES)
    except ValidationError as e:
        assert e.field == "text_input" and f"at most {MAX_PROMPT_BYTES} bytes" in str(e)
    else:
        raise AssertionError("accepted")
