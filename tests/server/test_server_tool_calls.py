"""Tool calls with the official `openai` client against the gateway and a real tritonserver on the
default model (SmolLM2-135M-Instruct, whose template has no tools: the system-prompt rendering):
every tool_choice, streamed and whole, parallel and not, gives the same calls both ways; streamed
calls come in OpenAI's chunk shape, a forced call's name before its arguments, the arguments in
several fragments; a forced call cut by max_tokens is the same partial call both ways; a call's
result goes back to the model. And a template that takes tools (the tiny test model's tokenizer with
a Llama-3-style template, through the gateway's --tokenizer) renders them end to end."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import TEST_MODEL, openai_server
from tests.server.test_server_guided_decoding import QUESTION, TIME, WEATHER, needs_default_model
from tests.unit.test_chat_template import LLAMA_STYLE

pytestmark = pytest.mark.server
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CHOICES = {"auto": "auto", "required": "required", "named": NAMED}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def client(smol_server):
    with openai_server(smol_server) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


def whole(client, **kwargs) -> tuple[str | None, list[tuple[str, str, str]], str]:
    """(content, [(id, name, arguments)], finish_reason) of an answer."""
    choice = client.chat.completions.create(model="specserve", **kwargs).choices[0]
    calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


def streamed(client, **kwargs) -> tuple[str | None, list[tuple[str, str, str]], str, list]:
    """whole()'s answer added up from the chunks, and the chunks' tool call deltas."""
    chunks = [c for c in client.chat.completions.create(model="specserve", stream=True, **kwargs) if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        call = calls.setdefault(delta.index, ["", "", ""])
        call[0] += delta.id or ""
        call[1] += (delta.function.name or "") if delta.function else ""
        call[2] += (delta.function.arguments or "") if delta.function else ""
    [finish] = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    return content or None, [tuple(c) for c in calls.values()], finish, deltas


def same_both_ways(client, **kwargs):
    """The answer whole and streamed: the same content, calls and finish reason. Returns it."""
    content, calls, finish = whole(client, **kwargs)
    s_content, s_calls, s_finish, deltas = streamed(client, **kwargs)
    assert (s_content, [c[1:] for c in s_calls], s_finish) == (content, [c[1:] for c in calls], finish)
    for index, (call_id, name, _) in enumerate(s_calls):  # OpenAI's shape: index, id, type and name first
        first, *rest = [d for d in deltas if d.index == index]
        assert first.id == call_id and call_id.startswith("call_") and first.type == "function"
        assert first.function.name == name and all(d.id is None and not d.function.name for d in rest)
    assert all(c[0].startswith("call_") for c in calls)
    return content, calls, finish, deltas


@needs_default_model
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", CHOICES)
def test_every_tool_choice_gives_the_same_calls_streamed_and_whole(client, choice, parallel):
    content, calls, finish, deltas = same_both_ways(
        client, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=CHOICES[choice], max_tokens=120,
        temperature=0, parallel_tool_calls=parallel)
    if choice == "auto" and not calls:  # the model chose to answer
        assert content and finish in ("stop", "length")
        return
    assert calls and (content is None or choice == "auto")
    if finish == "tool_calls":  # whole: every call fits its tool
        for _, name, arguments in calls:
            jsonschema.validate(json.loads(arguments), TOOLS[name]["function"]["parameters"])
    assert len(calls) == 1 or parallel
    if choice != "auto":  # the name first, the arguments as they come
        assert len([d for d in deltas if d.index == 0]) > 2


@needs_default_model
@pytest.mark.parametrize("choice,max_tokens", [("required", 14), ("named", 6)])  # past the name, within the arguments
def test_a_forced_call_cut_by_max_tokens_is_the_same_partial_call_both_ways(client, choice, max_tokens):
    content, [(_, name, arguments)], finish, _ = same_both_ways(
        client, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=CHOICES[choice], max_tokens=max_tokens,
        temperature=0)
    assert content is None and finish == "length" and name == "get_weather"
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)


@needs_default_model
def test_a_parser_named_by_the_request_reads_the_same_both_ways(client):
    """The default model writes no Llama 3 JSON: whatever it writes is read the same both ways."""
    same_both_ways(client, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=60,
                   temperature=0, extra_body={"tool_call_parser": "llama3_json"})
    with pytest.raises(openai.BadRequestError) as error:
        whole(client, messages=QUESTION, tools=[WEATHER], max_tokens=4, extra_body={"tool_call_parser": "nope"})
    assert error.value.body["param"] == "tool_call_parser"


@needs_default_model
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_call_and_its_result_go_back_to_the_model(client, choice, stream):
    # one call: the small model, free to call in parallel, repeats its call until max_tokens
    kwargs = dict(messages=QUESTION, tools=[WEATHER, TIME], tool_choice=CHOICES[choice], max_tokens=80,
                  temperature=0, parallel_tool_calls=False)
    _, [(call_id, name, arguments)], finish, *_ = streamed(client, **kwargs) if stream else whole(client, **kwargs)
    assert finish == "tool_calls" and name == "get_weather" and "paris" in arguments.lower()
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    conversation = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    answer, calls, finish = whole(client, messages=conversation, tools=[WEATHER, TIME], tool_choice="none",
                                  max_tokens=60, temperature=0)
    assert answer and not calls and finish in ("stop", "length")


def test_a_template_that_takes_tools_renders_them_end_to_end(server, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TEST_MODEL)
    tokenizer.chat_template = LLAMA_STYLE
    tokenizer.save_pretrained(tmp_path)
    kwargs = dict(messages=QUESTION, tools=[WEATHER, TIME], max_tokens=40, temperature=0)
    with openai_server(server, "--tokenizer", str(tmp_path)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        for choice in ("required", "auto"):  # auto: read as Llama 3 JSON, the template's format
            same_both_ways(client, tool_choice=choice, **kwargs)
        _, calls, _ = whole(client, tool_choice="required", **kwargs)
        assert calls and calls[0][1] in TOOLS
        usage = client.chat.completions.create(model="specserve", tool_choice="required", **kwargs).usage
    rendered = tokenizer.apply_chat_template(QUESTION, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<s>") and "get_time" in rendered
    # the template's prompt, its BOS once (the gateway leaves it to `llm`'s tokenizer)
    assert usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
