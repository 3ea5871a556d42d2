"""OpenAI tool calling: the request's tools checked, shown to the model, and its calls read back.

    tools          each {"type": "function", "function": {"name", "description", "parameters"}}
    tool_choice    "none": no tools shown; "auto" (the default with tools): the model may answer or
                   call, in its own format (serving/gateway/tool_parsers.py); "required": the
                   output is constrained to a JSON array of calls, each {"name", "arguments"}
                   matching one tool's parameters (one call when parallel_tool_calls is false);
                   {"type": "function", "function": {"name": N}}: the output is N's arguments
    tool_call_parser  (vLLM's name) hermes, llama3_json or mistral: the format `auto` calls are
                   read in; by default the model's template's (serving/gateway/chat_template.py)

A model whose chat template takes `tools` gets them, its calls and the tools' results through that
template. Otherwise (SmolLM2's template has no tools) the tools go into the system prompt and calls
are written Hermes-style: an assistant message's `tool_calls` become <tool_call> blocks, a `tool`
message a user turn holding <tool_response>...</tool_response>.

In `auto` mode each block is read on its own: one that does not parse, names no tool, or whose
arguments do not satisfy the tool's parameters (JsonChecker: the grammar a forced call would be
constrained by) stays in the message's content as the model wrote it, and the reason is logged;
the calls that did parse are kept, and so is the text around them. Arguments written as a JSON
string holding an object are taken. With parallel_tool_calls false the first call is kept and the
others are dropped (logged). A forced call cut off by max_tokens is returned as far as it was
written (finish_reason "length"), streamed or not.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

from backend.core.json_schema import prepare
from backend.errors import ValidationError
from serving.gateway.tool_parsers import PARSER_NAMES, PARSERS, Block, CallArrayReader, ToolParser

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL_START = "<tool_call>"
MAX_TOOLS = 128
log = logging.getLogger(__name__)


class ToolError(ValueError):
    """A tools request OpenAI would refuse: `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text; a forced call cut by max_tokens: as far as it was written
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index} | call


@dataclass(slots=True)
class Tools:
    """A request's tools and how it wants them used."""
    functions: dict[str, dict]  # name -> {"description", "parameters"}
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None  # the function tool_choice names
    parallel: bool = True
    parser: ToolParser = PARSERS["hermes"]  # the format `auto` calls are written in

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def system_prompt(self) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": {"name": n, **f}}) for n, f in self.functions.items())
        return ("You are a function calling AI model. You may call one or more of these functions to help with "
                f"the user's request:\n<tools>\n{listed}\n</tools>\nFor each function call, write a JSON object "
                "with the function's name and arguments within <tool_call></tool_call> tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def guided_decoding(self) -> dict | None:
        """The constraint a forced call puts on the output."""
        if self.choice == "named":
            return {"json": self.functions[self.named]["parameters"]}
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": f["parameters"]},
                  "required": ["name", "arguments"]} for n, f in self.functions.items()]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return {"json": schema}

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the message's content, its calls) from the model's whole output."""
        if self.forced:
            calls = self.forced_calls(text)
            return (None, calls) if calls else (text, [])
        content, calls = self.read(text, final=True)
        return (content if content.strip() or not calls else None), calls

    def forced_calls(self, text: str, reader: CallArrayReader | None = None) -> list[ToolCall]:
        """A forced answer's calls, as far as they were written (max_tokens may cut one): the
        arguments exactly as the model wrote them."""
        if self.choice == "named":
            return [ToolCall(self.named, text)]
        if reader is None:
            reader = CallArrayReader()
            reader.feed(text)
        return [ToolCall(name, arguments) for name, arguments in reader.calls()]

    def read(self, text: str, final: bool, cache: dict[int, tuple[list[ToolCall], str]] | None = None,
             memo: dict[int, tuple] | None = None) -> tuple[str, list[ToolCall]]:
        """An `auto` answer's decided part (all of it when `final`): (its content: the text with
        the calls taken out, its calls). `cache` keeps each block's reading between calls on a
        growing answer (the same ids, one log line), `memo` where an open block was left."""
        cache = {} if cache is None else cache
        content: list[str] = []
        calls: list[ToolCall] = []
        for part in self.parser.scan(text, final, memo).parts:
            if isinstance(part, str):
                content.append(part)
                continue
            if part.start not in cache:
                cache[part.start] = self._block(part)
            accepted, left = cache[part.start]
            for call in accepted:
                if calls and not self.parallel:
                    if final:
                        log.info("a call after the first is dropped: parallel_tool_calls is false")
                    continue
                calls.append(call)
            content.append(left)
        return "".join(content), calls

    def _block(self, block: Block) -> tuple[list[ToolCall], str]:
        """A block's calls, and the text it leaves in the content: all of it if no call is
        taken, else the calls that were not (as JSON)."""
        try:
            values = block.calls()
        except ValueError as e:
            log.info("a tool call block is left as content: it is not JSON (%s)", e)
            return [], block.raw
        accepted, rejected = [], []
        for value in values:
            call, reason = self._call(value)
            if call is None:
                log.info("a tool call is left as content: %s", reason)
                rejected.append(value)
            else:
                accepted.append(call)
        if not accepted:
            return [], block.raw
        return accepted, "".join(json.dumps(value) for value in rejected)

    def _call(self, value: Any) -> tuple[ToolCall | None, str]:
        """A call's JSON value as a call, or (None, why it is not one)."""
        try:
            name, arguments = value["name"], _arguments(value)
        except (json.JSONDecodeError, TypeError, KeyError, ValueError) as e:
            return None, f"it is not {{\"name\": ..., \"arguments\": {{...}}}} ({type(e).__name__})"
        if not isinstance(name, str) or name not in self.functions:
            return None, f"it names no tool of the request ({str(name)[:64]!r})"
        if not checker(self.functions[name]["parameters"]).matches(arguments):
            return None, f"its arguments do not satisfy {name}'s parameters"
        return ToolCall(name, json.dumps(arguments)), ""


def _arguments(call: dict) -> dict:
    """A call's arguments: an object, or a JSON string holding one; ValueError otherwise."""
    if not isinstance(call, dict):
        raise ValueError("a call must be an object")
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be an object")
    return arguments


def read_tools(body: dict, parser: ToolParser = PARSERS["hermes"]) -> Tools | None:
    """The request's tools and tool_choice, checked; None when it has none (or tool_choice none).
    `parser`: the format `auto` calls are read in unless the request's tool_call_parser says."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parser_name = body.get("tool_call_parser")
    if parser_name is not None:
        if parser_name not in PARSERS:
            raise ToolError("tool_call_parser", f"tool_call_parser must be one of {', '.join(PARSER_NAMES)}")
        parser = PARSERS[parser_name]
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise ToolError("tools", f"tools must be a list of 1 to {MAX_TOOLS} tools")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise ToolError(f"tools[{i}]", 'each tool must be {"type": "function", "function": {...}}')
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name) or name in functions:
            raise ToolError(f"tools[{i}].function.name", "a function name must be 1 to 64 letters, digits, _ or -, "
                                                         "and unique")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(f"tools[{i}].function.parameters", "parameters must be a JSON Schema object")
        description = function.get("description", "")
        if not isinstance(description, str):
            raise ToolError(f"tools[{i}].function.description", "description must be a string")
        functions[name] = {"description": description, "parameters": parameters}
    if choice in (None, "auto", "none", "required"):
        if choice == "none":
            return None
        _check_parameters(functions, checked=choice != "required")
        return Tools(functions, choice or "auto", parallel=parallel is not False, parser=parser)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if named is None:
        raise ToolError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                       '{"type": "function", "function": {"name": ...}}')
    if named not in functions:
        raise ToolError("tool_choice", f"tool_choice names {named!r}, which is not among the tools")
    _check_parameters(functions, checked=False)
    return Tools(functions, "named", named, parallel=parallel is not False, parser=parser)


def _check_parameters(functions: dict[str, dict], checked: bool) -> None:
    """Each tool's parameters hold no keyword that cannot be enforced (a forced call is constrained
    by them) and, with `checked` (auto: calls are checked against them), compile to a JsonChecker."""
    for i, function in enumerate(functions.values()):
        try:
            if checked:
                checker(function["parameters"])
            else:
                prepare(function["parameters"])
        except ValidationError as e:
            raise ToolError(f"tools[{i}].function.parameters", e.message) from None


def checker(parameters: dict):
    """The JsonChecker of a tool's parameters. Its module is imported on first use, or by the
    gateway's warm-up at start (server.py): xgrammar imports torch, seconds the gateway need not
    wait for before it serves."""
    from backend.core.grammar_compiler import json_checker

    return json_checker(json.dumps(parameters))


def render_messages(messages: list[dict], tools: Tools | None) -> list[dict]:
    """The conversation as the chat template takes it (role and content strings): the tools in
    the system prompt, calls and results written out as the model writes and reads them."""
    out = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = [f"{CALL_START}\n{_call_json(c)}\n</tool_call>" for c in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools is not None:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{tools.system_prompt()}"}
        else:
            out.insert(0, {"role": "system", "content": tools.system_prompt()})
    return out


def _call_json(call: Any) -> str:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass
    return json.dumps({"name": function.get("name", ""), "arguments": arguments})


