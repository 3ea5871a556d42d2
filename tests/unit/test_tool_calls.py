"""OpenAI tools for a template without tools (serving/gateway/tool_calls.py): rendering, constraints,
reading whole answers, and the requests OpenAI refuses. Streams: test_tool_stream.py; the
formats: test_tool_parsers.py."""
from __future__ import annotations

import json

import pytest

from serving.gateway.protocol import OpenAIError, chat_inputs
from serving.gateway.tool_calls import ToolError, read_tools, render_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def tools(choice="auto", parallel=None):
    return read_tools({"tools": [WEATHER, TIME], "tool_choice": choice, "parallel_tool_calls": parallel})


def test_tools_go_into_the_system_prompt_and_calls_and_results_are_written_back():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}]
    rendered = render_messages(messages, tools())
    assert rendered[0]["role"] == "system" and rendered[0]["content"].startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in rendered[0]["content"] and "<tools>" in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant", "content": CALL}
    assert rendered[3] == {"role": "user", "content": '<tool_response>\n{"sky": "sunny"}\n</tool_response>'}
    assert render_messages(messages[1:2], tools())[0]["role"] == "system"  # a system turn is added
    assert render_messages(messages[1:2], None) == [messages[1]]


def test_forced_calls_become_json_schema_constraints():
    named = tools({"type": "function", "function": {"name": "get_time"}})
    assert named.guided_decoding() == {"json": TIME["function"]["parameters"]}
    required = tools("required", parallel=False).guided_decoding()["json"]
    assert required["maxItems"] == 1 and required["minItems"] == 1
    assert [c["properties"]["name"] for c in required["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                           {"const": "get_time"}]
    assert "maxItems" not in tools("required").guided_decoding()["json"]
    assert tools("auto").guided_decoding() is None


def test_parsing_whole_answers():
    content, [call] = tools().parse("Let me check.\n" + CALL)
    assert content == "Let me check.\n" and (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")
    assert tools().parse("It is sunny.") == ("It is sunny.", [])
    assert tools().parse('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')[1] == []  # not a tool
    assert tools().parse("<tool_call>{broken")[1] == []
    _, calls = tools("required").parse('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                                       '"arguments": {"city": "Oslo"}}]')
    assert [c.name for c in calls] == ["get_time", "get_weather"]
    named = tools({"type": "function", "function": {"name": "get_weather"}})
    content, [call] = named.parse('{"city":  "Rome"}')
    assert content is None and call.arguments == '{"city":  "Rome"}'  # as written
    assert named.parse('{"city": "Ro')[1][0].arguments == '{"city": "Ro'  # cut by max_tokens: as far as written
    _, [cut] = tools("required").parse('[{"name": "get_weather", "arguments": {"city": "Os')
    assert (cut.name, cut.arguments) == ("get_weather", '{"city": "Os')
    assert tools("required").parse('[{"name": "get_wea') == ('[{"name": "get_wea', [])  # no name yet: content


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": []}, "tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_requests_openai_refuses(body, param):
    with pytest.raises(ToolError) as error:
        read_tools(body)
    assert error.value.param == param


@pytest.mark.parametrize("response_format,guide", [
    ({"type": "text"}, None), ({"type": "json_object"}, {"json": {"type": "object", "x-strict": False}}),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}},
     {"json": {"type": "object"}}),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
     {"json": {"type": "object", "x-strict": False}}),
])
def test_response_format_becomes_guided_decoding(response_format, guide):
    request = chat_inputs({"messages": [{"role": "user", "content": "hi"}], "response_format": response_format})
    assert request.guided_decoding == guide
    parameters = request.sampling_parameters()
    assert (json.loads(parameters)["guided_decoding"] if parameters else None) == guide


def test_response_format_with_a_forced_call_is_refused():
    with pytest.raises(OpenAIError) as error:
        chat_inputs({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": "required",
                     "response_format": {"type": "json_object"}})
    assert error.value.param == "response_format"


def test_response_format_with_tools_in_auto_mode_is_refused():
    """The format constrains the whole answer, so a <tool_call> could never be written."""
    for choice in ("auto", None):
        with pytest.raises(OpenAIError) as error:
            chat_inputs({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": choice,
                         "response_format": {"type": "json_object"}})
        assert error.value.param == "response_format" and "tool_choice 'auto'" in str(error.value)
    chat_inputs({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": "none",
                 "response_format": {"type": "json_object"}})  # no tools shown: the format alone


def block(name: str, arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


BROKEN = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>"


@pytest.mark.parametrize("bad", [BROKEN, block("get_stock", {"symbol": "X"}), block("get_weather", {"city": 7}),
                                 block("get_weather", {}), block("get_weather", [1])],
                         ids=["malformed", "unknown_name", "wrong_type", "missing_required", "not_an_object"])
def test_a_bad_block_stays_content_and_the_calls_that_parsed_are_kept(bad, caplog):
    text = f"Checking.\n{block('get_weather', {'city': 'Paris'})}\n{bad}\n{block('get_time', {})}\nDone."
    with caplog.at_level("INFO", logger="serving.gateway.tool_calls"):
        content, calls = tools().parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert content == f"Checking.\n\n{bad}\n\nDone."
    assert "left as content" in caplog.text


def test_arguments_as_a_json_string_extra_keys_and_key_order_are_taken():
    content, calls = tools().parse(block("get_weather", json.dumps({"city": "Oslo"})) + "\nThat is all.")
    assert content == "\nThat is all." and json.loads(calls[0].arguments) == {"city": "Oslo"}
    unit = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}}
    auto = read_tools({"tools": [unit]})
    assert auto.parse(block("get_weather", {"unit": "c", "city": "Rome", "note": "x"}))[1]  # JSON Schema allows both
    assert not auto.parse(block("get_weather", {"unit": "k", "city": "Rome"}))[1]


def test_parallel_tool_calls_false_keeps_the_first_call_in_auto_mode():
    text = block("get_weather", {"city": "Paris"}) + "\n" + block("get_time", {})
    assert [c.name for c in tools(parallel=False).parse(text)[1]] == ["get_weather"]
    assert [c.name for c in tools().parse(text)[1]] == ["get_weather", "get_time"]


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_whose_parameters_cannot_be_enforced_is_refused(choice):
    sets = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
    with pytest.raises(ToolError) as error:
        read_tools({"tools": [WEATHER, sets], "tool_choice": choice})
    assert error.value.param == "tools[1].function.parameters" and "'uniqueItems' is not supported" in str(error.value)
    assert read_tools({"tools": [WEATHER, sets], "tool_choice": "none"}) is None  # not shown: not checked


@pytest.mark.parametrize("strict", [True, False])
def test_a_response_format_that_cannot_be_enforced_is_refused_naming_it(strict):
    schema = {"type": "object", "properties": {"ids": {"type": "array", "contains": {"const": 1}}}}
    with pytest.raises(OpenAIError) as error:
        chat_inputs({"messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}})
    assert error.value.param == "response_format"
    assert str(error.value) == "JSON Schema keyword 'contains' is not supported (at #/properties/ids)"
