"""Guided decoding through the interfaces users already have: vllm_backend's `guided_decoding`
(and `structured_outputs`) sampling parameter on `llm` and `llm_bls`, TensorRT-LLM's
`guided_decoding_guide_type` / `guided_decoding_guide` on `ensemble`, and OpenAI's
`response_format` and `tools` with the official client on the default chat model (tool calls
themselves: test_server_tool_calls.py). A constraint
that cannot compile is INVALID_ARG (HTTP 400) naming the field; the server serves on."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import numpy as np
import openai
import pytest
from tritonclient.utils import InferenceServerException

from backend.core.grammar_compiler import COMPILE_TIMEOUT_S
from client.stream import GenerationError, complete
from tests.server.conftest import DEFAULT_MODEL, openai_server
from tests.server.test_server_trtllm_clients import _inputs, run_ensemble

pytestmark = pytest.mark.server

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "size"]}
REGEX = r"(def|class) [a-z_]{1,12}\(\)"
needs_default_model = pytest.mark.skipif(not (DEFAULT_MODEL / "conversion.json").is_file(),
                                         reason="run scripts/convert_default_model.py (make test does)")


@pytest.mark.parametrize("model", ["llm", "llm_bls"])
@pytest.mark.parametrize("form", ["object", "json_text", "structured_outputs"])
def test_vllm_guided_decoding_parameter(server, model, form):
    guide = {"json": SCHEMA}
    key, value = ("structured_outputs", json.dumps(guide)) if form == "structured_outputs" else \
        ("guided_decoding", json.dumps(guide) if form == "json_text" else guide)
    for seed in range(3):
        out = complete(server.grpc_url, "import os\n", model=model, max_tokens=120,
                       sampling_parameters={key: value, "temperature": 1.0, "seed": seed, "return_finish_reason": True})
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.chunks[-1].finish_reason == "stop"


def test_regex_and_choice_over_http_generate(server):
    out = complete(server.http_url, "x = ", protocol="http", stream=False, max_tokens=40,
                   sampling_parameters=json.dumps({"guided_decoding": {"regex": REGEX}, "temperature": 1.0, "seed": 3}))
    assert re.fullmatch(REGEX, out.text)
    out = complete(server.http_url, "x = ", protocol="http", stream=False, max_tokens=40,
                   sampling_parameters=json.dumps({"guided_decoding": {"choice": ["alpha", "beta"]}}))
    assert out.text in ("alpha", "beta")


def json_object_or_its_head(text: str, tokenizer_dir) -> bool:
    """A `json` guide's output: a whole JSON object, or, where max_tokens ended it first, the head
    of one. Any JSON object is unbounded (a sampled string key can run on past any limit, at T = 1
    about 1 seed in 6 with the test model), and a guide cannot end a request before its grammar
    does, so an unfinished object is the length limit's and must be a valid head."""
    import xgrammar
    from transformers import AutoTokenizer

    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tokenizer_dir)))
    matcher = xgrammar.GrammarMatcher(compiler.compile_builtin_json_grammar())
    if not (text.startswith("{") and matcher.accept_string(text)):
        return False
    return not matcher.is_terminated() or isinstance(json.loads(text), dict)


@pytest.mark.parametrize("guide_type,guide,check", [
    ("json_schema", json.dumps(SCHEMA), lambda t, _: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ("json", "", json_object_or_its_head),
    ("regex", REGEX, lambda t, _: re.fullmatch(REGEX, t)),
    ("ebnf_grammar", 'root ::= "n = " [1-9] [0-9]{0,3}', lambda t, _: re.fullmatch(r"n = [1-9][0-9]{0,3}", t)),
])
def test_tensorrt_llm_guided_decoding_on_the_ensemble(server, guide_type, guide, check):
    extra = {"guided_decoding_guide_type": np.array([[guide_type]], dtype=object)}
    if guide:
        extra["guided_decoding_guide"] = np.array([[guide]], dtype=object)
    for seed in range(4):
        [result] = run_ensemble(server, _inputs(False, output_len=150, exclude_input_in_output=True,
                                                random_seed=np.array([[seed]], dtype=np.uint64), **extra))
        assert not isinstance(result, InferenceServerException), result
        assert check(result.as_numpy("text_output")[0].decode("utf-8"), server.model_dir), seed


def test_a_json_objects_head_is_told_from_invalid_text(server):
    head = '{"name": "a very long na'
    assert json_object_or_its_head(head, server.model_dir) and json_object_or_its_head(head + '"}', server.model_dir)
    assert not json_object_or_its_head('{"name": "x"} and more', server.model_dir)
    assert not json_object_or_its_head('{name: 1}', server.model_dir) and not json_object_or_its_head('[1]', server.model_dir)


def test_tensorrt_llm_streaming_with_exclude_input_in_output_false_streams_the_new_tokens(server):
    """end_to_end_grpc_client.py -S sends exclude_input_in_output false; TensorRT-LLM streams
    the new tokens."""
    greedy = {"top_k": np.array([[1]], dtype=np.int32), "random_seed": np.array([[5]], dtype=np.uint64)}
    results = run_ensemble(server, _inputs(True, exclude_input_in_output=False, **greedy))
    assert not [r for r in results if isinstance(r, InferenceServerException)]
    streamed = "".join(r.as_numpy("text_output")[0].decode("utf-8") for r in results)
    assert streamed == complete(server.grpc_url, "def fibonacci(n):", max_tokens=12, top_k=1, seed=5).text


BAD_GUIDES = {
    "schema_not_json": ({"guided_decoding": {"json": "{not json"}}, "guided_decoding: json is not valid JSON"),
    "schema_unsupported": ({"guided_decoding": {"json": {"type": "nonsense"}}}, "json does not compile"),
    "regex_unsatisfiable": ({"guided_decoding": {"regex": "[^\\s\\S]"}}, "regex matches no output"),
    "grammar_syntax_error": ({"guided_decoding": {"grammar": 'root ::= "a" |'}}, "grammar does not compile"),
    "two_constraints": ({"guided_decoding": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    "with_ignore_eos": ({"guided_decoding": {"regex": "a"}, "ignore_eos": True}, "cannot be combined"),
}


@pytest.mark.parametrize("name", BAD_GUIDES)
def test_a_bad_constraint_is_invalid_arg_naming_the_field(server, name):
    values, expected = BAD_GUIDES[name]
    with pytest.raises(GenerationError) as error:
        complete(server.http_url, "x", protocol="http", stream=False, max_tokens=4,
                 sampling_parameters=json.dumps(values))
    assert error.value.status == "400" and expected in str(error.value)
    with pytest.raises(GenerationError, match=re.escape(expected)):
        complete(server.grpc_url, "x", max_tokens=4, sampling_parameters=values)
    assert complete(server.grpc_url, "x", max_tokens=4, sampling_parameters={
        "guided_decoding": {"choice": ["ok"]}}).text == "ok"  # serves on


@pytest.mark.parametrize("extra,field", [
    ({"guided_decoding_guide_type": "xml", "guided_decoding_guide": "a"}, "guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": "regex"}, "guided_decoding_guide"),
    ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "[a-"}, "guided_decoding"),
])
def test_a_bad_tensorrt_llm_guide_is_refused_by_name(server, extra, field):
    [error] = run_ensemble(server, _inputs(False, **{k: np.array([[v]], dtype=object) for k, v in extra.items()}))
    assert isinstance(error, InferenceServerException) and f"{field}: " in error.message()


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def openai_client(smol_server):
    with openai_server(smol_server) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


@needs_default_model
@pytest.mark.parametrize("stream", [False, True])
def test_openai_response_format_json_schema(openai_client, stream):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    kwargs = dict(model="specserve", messages=[{"role": "user", "content": "Name a famous city and its country."}],
                  max_tokens=60, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema,
                                                                          "strict": True}})
    jsonschema.validate(json.loads(_content(openai_client, stream, kwargs)), schema)
    reply = openai_client.chat.completions.create(**kwargs | {"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def _content(client, stream: bool, kwargs: dict) -> str:
    """The answer's content, gathered from its chunks when streamed."""
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    return client.chat.completions.create(**kwargs).choices[0].message.content


@needs_default_model
@pytest.mark.parametrize("kwargs,param", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format"),
    (dict(response_format={"type": "yaml"}), "response_format"),
])
def test_openai_bad_tools_and_formats_are_400_naming_the_parameter(openai_client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.chat.completions.create(model="specserve", messages=QUESTION, max_tokens=8, **kwargs)
    assert error.value.body["param"] == param
    assert openai_client.chat.completions.create(model="specserve", messages=QUESTION, max_tokens=4).choices


def _nested(depth: int) -> dict:
    """Arrays of arrays: one JSON level per schema level, within the gateway's bound on a body's nesting."""
    return json.loads('{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth)


HOSTILE_OR_UNSUPPORTED = {
    "uniqueItems": ({"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"},
                                                              "uniqueItems": True}}},
                    "JSON Schema keyword 'uniqueItems' is not supported"),
    "oneOf_overlapping": ({"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]},
                          "JSON Schema keyword 'oneOf' is not supported"),
    "deep_nesting": (_nested(40), "nests deeper than 32"),
    "huge_regex_repetition": ({"type": "string", "pattern": "^[a-z]{1,10000}$"}, "repeats too much"),
    "thousands_of_properties": ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}},
                                "properties in all, the most supported"),
}


@needs_default_model
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("name", HOSTILE_OR_UNSUPPORTED)
def test_an_unsupported_or_hostile_schema_is_400_at_once_and_the_server_stays_ready(openai_client, name, strict):
    """Refused before anything compiles (backend/core/json_schema.py), well within the compile
    time bound; the next request is served."""
    schema, message = HOSTILE_OR_UNSUPPORTED[name]
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.chat.completions.create(
            model="specserve", messages=QUESTION, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}})
    assert time.monotonic() - start < COMPILE_TIMEOUT_S
    assert error.value.body["param"] == "response_format" and message in error.value.body["message"]
    assert openai_client.chat.completions.create(model="specserve", messages=QUESTION, max_tokens=4).choices


def test_an_unsupported_keyword_is_invalid_arg_on_llm_too(server):
    values = {"guided_decoding": {"json": {"type": "array", "contains": {"const": 1}}}}
    with pytest.raises(GenerationError, match="guided_decoding: JSON Schema keyword 'contains' is not supported"):
        complete(server.grpc_url, "x", max_tokens=4, sampling_parameters=values)
    assert complete(server.grpc_url, "x", max_tokens=4, sampling_parameters={
        "guided_decoding": {"choice": ["ok"]}}).text == "ok"


@needs_default_model
def test_openai_tools_in_auto_mode_with_a_response_format_are_400(openai_client):
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.chat.completions.create(model="specserve", messages=QUESTION, max_tokens=8, tools=[WEATHER],
                                              tool_choice="auto", response_format={"type": "json_object"})
    assert error.value.body["param"] == "response_format"


@needs_default_model
@pytest.mark.parametrize("stream", [False, True])
def test_openai_json_schema_not_strict_validates(openai_client, stream):
    """strict false (OpenAI's default): JSON Schema's reading, whitespace free; the answer parses and
    fits the schema."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"]}
    kwargs = dict(model="specserve", messages=[{"role": "user", "content": "Name a famous city and its country."}],
                  max_tokens=80, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    jsonschema.validate(json.loads(_content(openai_client, stream, kwargs)), schema)
