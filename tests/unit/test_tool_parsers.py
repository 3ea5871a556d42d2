"""The tool call formats (serving/gateway/tool_parsers.py) read in `auto` mode on exact answers:
several calls, text after them, malformed blocks, unknown names, arguments written as a JSON
string; and the reader of `required` answers."""
from __future__ import annotations

import json

import pytest

from serving.gateway.tool_calls import read_tools
from serving.gateway.tool_parsers import PARSERS, CallArrayReader, json_end, parser_for_template

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def read(parser: str, text: str, parallel: bool | None = None):
    tools = read_tools({"tools": [WEATHER, TIME], "tool_call_parser": parser, "parallel_tool_calls": parallel})
    content, calls = tools.parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


PARIS, TIME_CALL = ("get_weather", {"city": "Paris"}), ("get_time", {})

CASES = {
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
        ('  {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
         None, [PARIS, TIME_CALL]),
        ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\nIt is done.', "\nIt is done.", [PARIS]),
        ('{"name": "get_stock", "parameters": {}}; {"name": "get_time", "parameters": {}}',
         '{"name": "get_stock", "parameters": {}}', [TIME_CALL]),  # unknown name: content, the other kept
        ('{"name": "get_weather", "parameters": {"city": 7}}', '{"name": "get_weather", "parameters": {"city": 7}}', []),
        ('{"name": "get_weather", "parameters": {"city": "Par', '{"name": "get_weather", "parameters": {"city": "Par', []),
        ('{"name": "get_weather" "parameters": {}}', '{"name": "get_weather" "parameters": {}}', []),  # malformed
        ('It is sunny. {"name": "get_time", "parameters": {}}', 'It is sunny. {"name": "get_time", "parameters": {}}',
         []),  # calls open the answer or are not calls
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
         None, [PARIS, TIME_CALL]),
        ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),  # the marker dropped
        ('Let me look. [TOOL_CALLS] [{"name": "get_time", "arguments": {}}] Done.', "Let me look.  Done.", [TIME_CALL]),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": 1}}, {"name": "get_time", "arguments": {}}]',
         '{"name": "get_weather", "arguments": {"city": 1}}', [TIME_CALL]),  # the bad call as JSON, the other kept
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]', None, [PARIS]),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}', '[TOOL_CALLS][{"name": "get_weather", '
         '"arguments": {"city": "Paris"}', []),  # cut: content
        ("[1] says it is sunny.", "[1] says it is sunny.", []),
        ("[TOOL_CALLS] none today", "[TOOL_CALLS] none today", []),
    ],
    "hermes": [
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> and after', " and after", [PARIS, TIME_CALL]),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', '<tool_call>{"name": "get_weather", '
         '"arguments": {"city": "Paris"}}', []),  # never closed: content
    ],
}


@pytest.mark.parametrize("parser,text,content,calls", [(p, *case) for p, cases in CASES.items() for case in cases])
def test_auto_answers_in_each_format(parser, text, content, calls):
    assert read(parser, text) == (content, calls)


def test_parallel_tool_calls_false_keeps_the_first_call_in_every_format():
    texts = {"llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", '
                            '"parameters": {}}',
             "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
                        '"arguments": {}}]',
             "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
                       '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'}
    for parser, text in texts.items():
        assert read(parser, text, parallel=False)[1] == [PARIS], parser
        assert read(parser, text)[1] == [PARIS, TIME_CALL], parser


def test_a_template_names_its_format():
    assert parser_for_template("{% for tool in tools %}...<tool_call>\n{{ tool_call | tojson }}") is PARSERS["hermes"]
    assert parser_for_template('{{- "<|python_tag|>" }}{"name": ..., "parameters": ...}') is PARSERS["llama3_json"]
    assert parser_for_template("[AVAILABLE_TOOLS] {{ tools }}[/AVAILABLE_TOOLS] ... [TOOL_CALLS]") is PARSERS["mistral"]
    assert parser_for_template("{{ message['content'] }}") is PARSERS["hermes"]


def test_an_unknown_parser_is_refused_by_name():
    from serving.gateway.tool_calls import ToolError
    with pytest.raises(ToolError) as error:
        read_tools({"tools": [WEATHER], "tool_call_parser": "pythonic"})
    assert error.value.param == "tool_call_parser"


def test_json_end_skips_brackets_in_strings():
    text = '{"a": "}]", "b": [1, {"c": "\\"}"}]} tail'
    assert json_end(text, 0) == len(text) - len(" tail")
    assert json_end('{"a": [1, 2', 0) is None
    memo: dict = {}  # a growing text read once: the same ends as reading each prefix afresh
    assert [json_end(text[:n], 0, memo) for n in range(len(text) + 1)] == [json_end(text[:n], 0)
                                                                          for n in range(len(text) + 1)]


def test_a_required_answer_is_read_as_it_comes():
    text = '[{"name": "get_weather", "arguments": {"city": "P\\"a}ris"}}, {"name":"get_time","arguments":{}}]'
    whole = CallArrayReader()
    whole.feed(text)
    assert whole.calls() == [("get_weather", '{"city": "P\\"a}ris"}'), ("get_time", "{}")]
    piecewise = CallArrayReader()
    seen = []
    for ch in text:
        piecewise.feed(ch)
        seen.append(piecewise.calls())
    assert piecewise.calls() == whole.calls()
    name_known = text.index('"get_weather"') + len('"get_weather"')
    assert seen[name_known - 2] == [] and seen[name_known - 1] == [("get_weather", "")]  # the name when it closes
    assert seen[text.index("P\\") - 1] == [("get_weather", '{"city": "')]  # the arguments as they come
