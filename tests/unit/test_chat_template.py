"""Tools through the model's own chat template (serving/gateway/chat_template.py): a template that
takes `tools` gets them, the assistant's calls and the tools' results as it expects them, and its
format's parser reads the calls; a template without tools keeps the system-prompt rendering."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from serving.gateway.chat_template import ChatTemplate
from serving.launch.cli import tokenizer_dir
from serving.gateway.protocol import OpenAIError, chat_inputs
from tests.unit.test_tool_parsers import TIME, WEATHER

TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_pair" / "target"
# a Llama-3.1-style template written for this test: tools as JSON in the first user turn, calls as
# {"name": ..., "parameters": ...}, results in "ipython" turns
LLAMA_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if loop.first and tools %}<|user|>\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Answer with {\"name\": function name, \"parameters\": arguments}.\n{% endif %}"
    "{% if m.role == 'tool' %}<|ipython|>\n{{ m.content }}\n"
    "{% elif m.tool_calls %}<|assistant|>\n{% for c in m.tool_calls %}<|python_tag|>"
    "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}{% endfor %}"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture
def llama_style(tokenizer):
    tokenizer.chat_template = LLAMA_STYLE
    yield ChatTemplate(tokenizer)
    tokenizer.chat_template = AutoTokenizer.from_pretrained(TOKENIZER).chat_template


def test_a_template_with_tools_renders_them_and_names_its_parser(llama_style):
    assert llama_style.takes_tools and llama_style.parser.name == "llama3_json"
    conversation = QUESTION + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}]
    request = chat_inputs({"messages": conversation, "tools": [WEATHER, TIME]}, llama_style)
    prompt = request.inputs["text_input"]
    assert "messages" not in request.inputs and not prompt.startswith("<s>")  # `llm` adds the BOS itself
    assert prompt == ("<|user|>\nTools:\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n"
                      'Answer with {"name": function name, "parameters": arguments}.\n<|user|>\nWeather in Paris?\n'
                      '<|assistant|>\n<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
                      '<|ipython|>\n{"sky": "sunny"}\n<|assistant|>\n')
    assert request.tools.parser.name == "llama3_json"
    content, [call] = request.tools.parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert content is None and json.loads(call.arguments) == {"city": "Oslo"}


def test_a_request_without_tools_is_rendered_by_llm_as_before(llama_style):
    request = chat_inputs({"messages": QUESTION}, llama_style)
    assert json.loads(request.inputs["messages"]) == QUESTION and request.tools is None


def test_the_request_may_name_another_parser(llama_style):
    request = chat_inputs({"messages": QUESTION, "tools": [WEATHER], "tool_call_parser": "hermes"}, llama_style)
    assert request.tools.parser.name == "hermes"


def test_a_template_without_tools_keeps_the_system_prompt(tokenizer):
    template = ChatTemplate(tokenizer)
    assert not template.takes_tools
    request = chat_inputs({"messages": QUESTION, "tools": [WEATHER]}, template)
    [system, user] = json.loads(request.inputs["messages"])
    assert "<tools>" in system["content"] and user == QUESTION[0] and request.tools.parser.name == "hermes"


def test_a_conversation_the_template_refuses_is_a_400_naming_messages(tokenizer):
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}{{ tools }}"
    try:
        template = ChatTemplate(tokenizer)
        template.takes_tools = True  # the probe itself is refused; the request's rendering is what is tested
        with pytest.raises(OpenAIError) as error:
            chat_inputs({"messages": QUESTION, "tools": [WEATHER]}, template)
        assert error.value.param == "messages" and "roles must alternate" in str(error.value)
    finally:
        tokenizer.chat_template = AutoTokenizer.from_pretrained(TOKENIZER).chat_template


def test_a_qwen_style_template_renders_tools_and_is_read_as_hermes(tokenizer):
    tokenizer.chat_template = (
        "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
        "Write <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    try:
        template = ChatTemplate(tokenizer)
        request = chat_inputs({"messages": QUESTION, "tools": [WEATHER]}, template)
    finally:
        tokenizer.chat_template = AutoTokenizer.from_pretrained(TOKENIZER).chat_template
    assert template.takes_tools and template.parser.name == "hermes" and request.tools.parser.name == "hermes"
    assert request.inputs["text_input"].startswith("<|im_start|>system\n<tools>" + json.dumps(WEATHER))


def test_the_launcher_hands_the_gateway_preprocessings_tokenizer(tmp_path):
    (tmp_path / "preprocessing").mkdir()
    config = tmp_path / "preprocessing" / "config.pbtxt"
    config.write_text(f'parameters [\n  {{ key: "tokenizer", value: {{ string_value: "{TOKENIZER}" }} }}\n]\n')
    assert tokenizer_dir(tmp_path) == TOKENIZER
    config.write_text('parameters [\n  { key: "tokenizer", value: { string_value: "missing/dir" } }\n]\n')
    assert tokenizer_dir(tmp_path) is None
    assert tokenizer_dir(tmp_path / "nowhere") is None
