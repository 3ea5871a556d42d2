"""OpenAI's completions and chat completions, translated to and from the `llm` model.

Plain Python (no web framework): `completion_inputs` / `chat_inputs` validate an OpenAI request
body and return `llm`'s inputs (an OpenAIError, status 400, names the parameter otherwise);
`Accumulator` gathers `llm`'s responses into OpenAI's text, finish reason, usage and logprobs.
`response_format` (json_object, json_schema) becomes a guided-decoding constraint: json_schema
with `strict: true` as the engine's strict JSON (compact, the schema's properties only, unless it
says otherwise), json_object and json_schema without it as JSON Schema reads them (any
whitespace, properties beyond the schema's where it allows them: `"x-strict": false`,
backend/core/grammar_compiler.py). `tools`, `tool_choice` and `tool_call_parser` are
serving/gateway/tool_calls.py's; tools with a response_format are a 400 (the format leaves no room
for a call). A chat with tools whose model's template takes them (serving/gateway/chat_template.py)
is rendered here and sent as `text_input`; every other chat goes to `llm` as `messages`. What OpenAI has and this
server does not (n > 1, best_of, logit_bias, audio, ...) is a 400 naming the parameter, as OpenAI
does for a value it refuses.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from backend.core.json_schema import STRICT_KEY, prepare
from backend.errors import ValidationError
from serving.gateway.chat_template import ChatTemplate, ChatTemplateError, needs_template
from serving.gateway.tool_calls import ToolError, Tools, read_tools, render_messages
from serving.gateway.tool_parsers import PARSERS, ToolParser

MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5  # the completions API's own limit
UNSUPPORTED = {  # parameter -> the one value accepted
    "n": 1, "best_of": 1, "logit_bias": None, "functions": None,
    "function_call": None, "suffix": None, "audio": None, "modalities": None, "prediction": None,
}
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "tool_call_parser", "response_format")  # refused by completions
VLLM_EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos")  # checked by `llm`
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop"}


class OpenAIError(Exception):
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}} with its status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class GenerationRequest:
    inputs: dict[str, Any]  # `llm` inputs by name (client.stream.INPUT_TYPES)
    stream: bool
    include_usage: bool
    logprobs: int | None  # top-n per token, None: none
    echo_prompt: str | None  # completions with echo: the prompt text before the completion
    guided_decoding: dict | None = None  # the output's constraint (response_format, a forced tool call)
    tools: Tools | None = None  # the answer may be a tool call

    def sampling_parameters(self) -> str | None:
        """`llm`'s sampling_parameters input: what has no input of its own."""
        values = {"logprobs": self.logprobs} if self.logprobs is not None else {}
        if self.guided_decoding is not None:
            values["guided_decoding"] = self.guided_decoding
        return json.dumps(values) if values else None


def completion_inputs(body: dict) -> GenerationRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise OpenAIError("prompt must be one non-empty string", param="prompt")
    for name in CHAT_ONLY:
        if body.get(name) is not None:
            raise OpenAIError(f"{name} is a chat completions parameter", param=name)
    logprobs = _optional_int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    echo = _optional_bool(body, "echo")
    return GenerationRequest(
        {"text_input": prompt, **_sampling(body, "max_tokens")}, _stream(body), _include_usage(body),
        logprobs, prompt if echo else None,
    )


def chat_inputs(body: dict, template: ChatTemplate | None = None, parser: ToolParser | None = None,
                ) -> GenerationRequest:
    """`template`: the model's chat template where the gateway has it (--tokenizer); `parser`: the
    format of `auto` calls unless the request says (else the template's, else hermes)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list", param="messages")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise OpenAIError("each message needs a role", param=f"messages[{i}]")
        calls = message.get("tool_calls") if message["role"] == "assistant" else None
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            raise OpenAIError("tool_calls must be a list of calls", param=f"messages[{i}].tool_calls")
        content = "" if calls and message.get("content") is None else _content(message.get("content"), i)
        extra = {"tool_calls": calls} if calls else {}
        if message["role"] == "tool" and isinstance(message.get("tool_call_id"), str):
            extra["tool_call_id"] = message["tool_call_id"]
        chat.append({"role": message["role"], "content": content} | extra)
    native = template is not None and template.takes_tools  # the template renders tools itself
    parser = parser or (template.parser if native else PARSERS["hermes"])
    try:
        tools = read_tools(body, parser)
    except ToolError as e:
        raise OpenAIError(str(e), param=e.param) from None
    guide = _response_format(body.get("response_format"))
    if tools is not None and guide is not None:  # the format leaves no room for a call
        raise OpenAIError(f"response_format cannot be combined with tools and tool_choice {tools.choice!r}",
                          param="response_format")
    if tools is not None and tools.forced:
        guide = tools.guided_decoding()
    if native and needs_template(chat, tools):
        try:
            prompt = {"text_input": template.render(chat, body["tools"] if tools is not None else None)}
        except ChatTemplateError as e:
            raise OpenAIError(str(e), param="messages") from None
    else:
        prompt = {"messages": json.dumps(render_messages(chat, tools))}
    logprobs = None
    if _optional_bool(body, "logprobs"):
        logprobs = _optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif body.get("top_logprobs") is not None:
        raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return GenerationRequest(prompt | _sampling(body, max_tokens), _stream(body),
                             _include_usage(body), logprobs, None, guide, tools)


def _response_format(value: Any) -> dict | None:
    """OpenAI's response_format as a guided_decoding constraint; None for text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json": {"type": "object", STRICT_KEY: False}}
    strict = isinstance(value.get("json_schema"), dict) and bool(value["json_schema"].get("strict"))
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict) or not isinstance(spec.get("name", ""), str) \
                or not isinstance(spec.get("strict", False), (bool, type(None))):
            raise OpenAIError('json_schema must be {"name": str, "schema": {...}, "strict": bool}',
                              param="response_format")
        try:  # a keyword that cannot be enforced, or a schema past the bounds, is refused here at once
            prepare(schema, strict=strict)
        except ValidationError as e:
            raise OpenAIError(e.message, param="response_format") from None
        return {"json": schema if strict else {**schema, STRICT_KEY: False}}
    raise OpenAIError('response_format type must be "text", "json_object" or "json_schema"', param="response_format")


def _content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise OpenAIError("content must be a string or a list of text parts", param=f"messages[{index}].content")


def _sampling(body: dict, max_tokens_name: str) -> dict[str, Any]:
    for name, accepted in UNSUPPORTED.items():
        if body.get(name) not in (None, accepted):
            raise OpenAIError(f"{name} is not supported by this server; only {accepted!r}", param=name)
    inputs: dict[str, Any] = {}
    max_tokens = _optional_int(body, max_tokens_name, 1, 2**31 - 1)
    if max_tokens is not None:
        inputs["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise OpenAIError(f"{name} must be a number", param=name)
            inputs[name] = float(value)
    seed = _optional_int(body, "seed", 0, 2**64 - 1)
    if seed is not None:
        inputs["seed"] = seed
    for name in VLLM_EXTRAS:  # vLLM's OpenAI server takes these too (extra_body in the openai client)
        if body.get(name) is not None:
            inputs[name] = body[name]
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise OpenAIError("stop must be a string or a list of non-empty strings", param="stop")
        if stop:
            inputs["stop"] = stop
    return inputs


def _stream(body: dict) -> bool:
    return bool(_optional_bool(body, "stream"))


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise OpenAIError("stream_options must be an object", param="stream_options")
    return bool(options.get("include_usage"))


def _optional_int(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OpenAIError(f"{name} must be an integer in [{low}, {high}]", param=name)
    return value


def _optional_bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise OpenAIError(f"{name} must be a boolean", param=name)
    return value


@dataclass(slots=True)
class Delta:
    """What one `llm` response adds: text, logprob entries (vllm_backend's shape), the end."""
    text: str
    logprobs: list[dict]
    finish_reason: str | None


@dataclass(slots=True)
class Accumulator:
    """A request's responses gathered: the usage and, for a whole answer, text and logprobs."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, outputs: dict[str, Any]) -> Delta:
        """`outputs`: one `llm` response's outputs by name (decoded scalars)."""
        self.prompt_tokens = int(outputs.get("num_input_tokens") or self.prompt_tokens)
        self.completion_tokens += int(outputs.get("num_output_tokens") or 0)
        reason = outputs.get("finish_reason")
        reason = FINISH_REASONS.get(reason) if reason not in (None, "", "None") else None
        logprobs = json.loads(outputs["logprobs"]) if outputs.get("logprobs") else None
        delta = Delta(outputs.get("text_output") or "", logprobs or [], reason)
        self.text.append(delta.text)
        self.logprobs += delta.logprobs
        self.finish_reason = reason or self.finish_reason
        return delta

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def _ranked(entry: dict) -> tuple[dict, list[dict]]:
    """(the chosen token's entry, which `llm` puts first; every entry in rank order)."""
    return next(iter(entry.values())), sorted(entry.values(), key=lambda d: d["rank"])


def chat_logprobs(entries: list[dict], top: int) -> dict:
    """OpenAI chat's logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for entry in entries:
        chosen, ranked = _ranked(entry)
        content.append({
            "token": chosen["decoded_token"], "logprob": chosen["logprob"],
            "bytes": list(chosen["decoded_token"].encode("utf-8")),
            "top_logprobs": [{"token": d["decoded_token"], "logprob": d["logprob"],
                              "bytes": list(d["decoded_token"].encode("utf-8"))} for d in ranked[:top]],
        })
    return {"content": content}


def completion_logprobs(entries: list[dict], top: int, offset: int) -> dict:
    """The completions API's logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        chosen, ranked = _ranked(entry)
        offsets.append(offset)
        offset += len(chosen["decoded_token"])
        tokens.append(chosen["decoded_token"])
        token_logprobs.append(chosen["logprob"])
        tops.append({d["decoded_token"]: d["logprob"] for d in ranked[:top]})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
