"""Streamed tool calls (serving/gateway/tool_stream.py): in every tool_choice and format, the
deltas of an answer cut anywhere add up to the whole answer's message; names come as soon as they
are written, forced arguments as they come, and content is never held back past a possible call."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.gateway.tool_calls import read_tools
from serving.gateway.tool_stream import ToolStream
from tests.unit.test_tool_parsers import CASES, TIME, WEATHER

NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
AUTO = [(parser, text) for parser, cases in CASES.items() for text, _, _ in cases] + [("hermes", text) for text in (
    "Let me check.\n" + CALL + "\nAnd the time: <tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call> done",
    "No call here <tool_call> {broken",
    CALL + '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>tail',
    "plain answer", "  \n", "\n" + CALL, "a <tool_c",
)]
FORCED = [("required", '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'),
          ("required", '[{"name":"get_weather","arguments":{"city":"Pa'),  # cut by max_tokens
          ("required", '[{"name": "get_ti'), ("required", ""),
          (NAMED, '{"city": "Paris"}'), (NAMED, '{"city": "Pa')]


def tools(choice, parser="hermes", parallel=None):
    return read_tools({"tools": [WEATHER, TIME], "tool_choice": choice, "tool_call_parser": parser,
                       "parallel_tool_calls": parallel})


def streamed(stream: ToolStream, pieces: list[str]) -> tuple[str | None, list[tuple[str, str, str]], list[dict]]:
    """(content, [(id, name, arguments)], deltas) as a client adds up the deltas."""
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", "", ""])
            entry[0] += call.get("id", "")
            entry[1] += call.get("function", {}).get("name", "")
            entry[2] += call["function"].get("arguments", "")
    content = "".join(d.get("content", "") for d in deltas)
    return content or None, [tuple(c) for c in calls.values()], deltas


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def assert_same(choice, parser, text, cuts, parallel=None):
    whole_content, whole_calls = tools(choice, parser, parallel).parse(text)
    stream = ToolStream(tools(choice, parser, parallel))
    content, calls, _ = streamed(stream, pieces_of(text, cuts))
    assert content == (whole_content or None)  # no content and "" read the same in a stream
    assert [(name, arguments) for _, name, arguments in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert all(call_id.startswith("call_") for call_id, _, _ in calls) and stream.called == bool(whole_calls)


@pytest.mark.parametrize("parser,text", AUTO)
@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_auto_answers_streamed_in_any_pieces_give_the_whole_answers_message(parser, text, cuts):
    assert_same("auto", parser, text, cuts)
    assert_same("auto", parser, text, cuts, parallel=False)


@pytest.mark.parametrize("choice,text", FORCED)
@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_forced_answers_streamed_in_any_pieces_give_the_whole_answers_message(choice, text, cuts):
    assert_same(choice, "hermes", text, cuts)


def test_a_named_call_sends_its_name_before_any_text_and_its_arguments_as_they_come():
    stream = ToolStream(tools(NAMED))
    first = stream.feed("")
    assert first == [{"tool_calls": [{"index": 0, "id": first[0]["tool_calls"][0]["id"], "type": "function",
                                      "function": {"name": "get_weather", "arguments": ""}}]}]
    assert stream.feed('{"city": ') == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}]
    assert stream.feed('"Paris"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}]
    assert stream.finish() == [] and stream.called


def test_a_required_call_sends_its_name_once_written_and_its_arguments_as_they_come():
    stream = ToolStream(tools("required"))
    assert stream.feed('[{"name": "get_wea') == []
    [header] = stream.feed('ther", "arguments": ')
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert stream.feed('{"city": "Pa') == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}]
    assert stream.feed('ris"}}, {"name": "get_time", "arguments": {}}]')[1:] == [
        {"tool_calls": [{"index": 1, "id": stream.calls[1].id, "type": "function",
                         "function": {"name": "get_time", "arguments": ""}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}]


def test_auto_content_streams_up_to_a_possible_call_and_each_call_once_its_block_is_read():
    stream = ToolStream(tools("auto"))
    assert stream.feed("Let me ") == [{"content": "Let me "}]
    assert stream.feed("check. <tool") == [{"content": "check. "}]  # "<tool" could open a call
    assert stream.feed('_call>{"name": "get_weather", "arguments": {"city": "Paris"}}') == []
    header, arguments = stream.feed("</tool_call>")
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads(arguments["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert stream.feed(" Done.") == [{"content": " Done."}] and stream.finish() == []


def test_auto_whitespace_before_a_call_is_not_content():
    stream = ToolStream(tools("auto", "llama3_json"))
    assert stream.feed("\n ") == [] and stream.feed('{"name": "get_time", "parameters": ') == []
    assert [d["tool_calls"][0]["index"] for d in stream.feed("{}}")] == [0, 0]  # the object closed: read
    assert stream.finish() == [] and stream.called


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_c", "[TOOL_CALLS]", "<|python_tag|>", '{"name": "get_time", ',
             '"arguments": {}}', '"parameters": {}}', '{"name": "get_weather", "arguments": {"city": "Paris"}}',
             '{"name": "nope", "arguments": {}}', "{", "}", "[", "]", '"', "\\", ";", ",", " ", "\n", "Sure.", "x"]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join),
       cuts=st.lists(st.integers(0, 10_000), max_size=6), parallel=st.booleans())
def test_any_answer_streamed_in_any_pieces_gives_the_whole_answers_message(parser, text, cuts, parallel):
    """Answers made of the formats' own pieces (markers, braces, quotes, escapes, separators),
    however they fall: what was decided while streaming never changes."""
    assert_same("auto", parser, text, cuts, parallel)
