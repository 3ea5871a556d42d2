"""A model's chat template in the gateway (`--tokenizer DIR`, as Triton's OpenAI frontend takes it),
for tools: whether the template takes `tools` (transformers' apply_chat_template(tools=...)), and
which format its models write calls in (serving/gateway/tool_parsers.py).

A template that takes tools renders a request with tools (or with calls and tool results in its
conversation) here, in the gateway: the tools, the assistant's `tool_calls` and the `tool`
messages go to the template as it expects them, and `llm` gets the rendered prompt as its
`text_input`. Every other request is rendered by `llm`'s preprocessing, as before.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from serving.gateway.tool_parsers import ToolParser, parser_for_template
from serving.triton.request_builder import load_tokenizer

PROBE_TOOL = {"type": "function", "function": {
    "name": "specserve_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}


class ChatTemplateError(ValueError):
    """The template refused the conversation."""


class ChatTemplate:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        text = template if isinstance(template, str) else "\n".join(map(str, dict(template).values()))
        self.takes_tools = self._takes_tools()
        self.parser: ToolParser = parser_for_template(text)
        bos = tokenizer.bos_token
        # `llm` tokenizes text_input with the special tokens; a BOS the template writes would come twice
        adds_bos = bos is not None and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
        self.bos_to_strip = bos if adds_bos else None

    @classmethod
    def load(cls, path: str | Path) -> ChatTemplate:
        """A local directory's tokenizer as the preprocessing model loads it (without torch where
        that is the same tokenizer); anything else by name, as transformers finds it."""
        if Path(path).is_dir():
            return cls(load_tokenizer(Path(path)))
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)))

    def _takes_tools(self) -> bool:
        try:
            rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[PROBE_TOOL],
                                                          tokenize=False, add_generation_prompt=True)
        except (TemplateError, ValueError, TypeError):
            return False
        return PROBE_TOOL["function"]["name"] in rendered

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The prompt for `messages` (OpenAI's roles, assistant `tool_calls`, `tool` results) with
        `tools` (OpenAI's tool objects), ready for generation."""
        try:
            prompt = self.tokenizer.apply_chat_template([_template_message(m) for m in messages], tools=tools,
                                                        tokenize=False, add_generation_prompt=True)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template refused them: {str(e)[:200]}") from None
        if self.bos_to_strip and prompt.startswith(self.bos_to_strip):
            prompt = prompt[len(self.bos_to_strip):]
        return prompt


def needs_template(messages: list[dict], tools: Any) -> bool:
    """Whether a request is rendered with its tools by a template that takes them."""
    return tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def _template_message(message: dict) -> dict:
    """A message as chat templates read it: a call's arguments as an object."""
    out = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("tool_calls"):
        out["tool_calls"] = [_template_call(c) for c in message["tool_calls"]]
    return out


def _template_call(call: dict) -> dict:
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {"id": call.get("id", ""), "type": "function",
            "function": {"name": function.get("name", ""), "arguments": arguments}}
