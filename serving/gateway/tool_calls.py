"""OpenAI tool calling for a chat model whose template knows nothing of tools (SmolLM2's does not):
the tools are rendered into the system prompt, calls are written Hermes-style, and a call the
client forces is enforced by a JSON Schema constraint (guided decoding).

    tools          each {"type": "function", "function": {"name", "description", "parameters"}}
    tool_choice    "none": no tools shown; "auto" (the default with tools): the model may answer or
                   call, a call written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>;
                   "required": the output is a JSON array of calls, each {"name", "arguments"}
                   matching one tool's parameters (one call when parallel_tool_calls is false);
                   {"type": "function", "function": {"name": N}}: the output is N's arguments
Conversation turns carry the calls as the model writes them: an assistant message's `tool_calls`
become <tool_call> blocks, a `tool` message a user turn holding <tool_response>...</tool_response>.

In `auto` mode each <tool_call> block is read on its own: a block that does not parse, names no
tool, or whose arguments do not satisfy the tool's parameters (JsonChecker: the grammar a forced
call would be constrained by) stays in the message's content as the model wrote it, and the
reason is logged; the calls that did parse are kept, and so is the text around them. Arguments
written as a JSON string holding an object are taken. With parallel_tool_calls false the first
call is kept and the others are dropped (logged). A forced call that does not parse (cut off by
max_tokens) is left as the content.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

from backend.core.grammar_compiler import json_checker
from backend.core.json_schema import prepare
from backend.errors import ValidationError

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
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
    arguments: str  # JSON text
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
        if self.choice == "named":
            return (None, [ToolCall(self.named, _compact(text))]) if _is_json(text) else (text, [])
        if self.choice == "required":
            try:
                calls = [ToolCall(c["name"], json.dumps(_arguments(c))) for c in json.loads(text)]
                return None, calls
            except (json.JSONDecodeError, TypeError, KeyError, ValueError):
                return text, []
        content, calls = self.read_blocks(text)
        return (content.strip() or None, calls) if calls else (text, [])

    def read_blocks(self, text: str) -> tuple[str, list[ToolCall]]:
        """An `auto` answer's <tool_call> blocks: (the text with the calls taken out, the calls)."""
        calls: list[ToolCall] = []
        kept, start = [], 0
        for match in CALL_BLOCK.finditer(text):
            kept.append(text[start:match.start()])
            start = match.end()
            call, reason = self._call(match.group(1))
            if call is not None and calls and not self.parallel:
                log.info("a call after the first is dropped: parallel_tool_calls is false")
            elif call is None:
                log.info("a <tool_call> block is left as content: %s", reason)
                kept.append(match.group(0))
            else:
                calls.append(call)
        return "".join(kept) + text[start:], calls

    def _call(self, block: str) -> tuple[ToolCall | None, str]:
        """A block's call, or (None, why it is not one)."""
        try:
            call = json.loads(block)
            name, arguments = call["name"], _arguments(call)
        except (json.JSONDecodeError, TypeError, KeyError, ValueError) as e:
            return None, f"it is not {{\"name\": ..., \"arguments\": {{...}}}} ({type(e).__name__})"
        if not isinstance(name, str) or name not in self.functions:
            return None, f"it names no tool of the request ({str(name)[:64]!r})"
        if not json_checker(json.dumps(self.functions[name]["parameters"])).matches(arguments):
            return None, f"its arguments do not satisfy {name}'s parameters"
        return ToolCall(name, json.dumps(arguments)), ""


def _arguments(call: dict) -> dict:
    """A call's arguments: an object, or a JSON string holding one; ValueError otherwise."""
    arguments = call.get("arguments", {}) if isinstance(call, dict) else None
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be an object")
    return arguments


def read_tools(body: dict) -> Tools | None:
    """The request's tools and tool_choice, checked; None when it has none (or tool_choice none)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
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
        return Tools(functions, choice or "auto", parallel=parallel is not False)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if named is None:
        raise ToolError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                       '{"type": "function", "function": {"name": ...}}')
    if named not in functions:
        raise ToolError("tool_choice", f"tool_choice names {named!r}, which is not among the tools")
    _check_parameters(functions, checked=False)
    return Tools(functions, "named", named, parallel=parallel is not False)


def _check_parameters(functions: dict[str, dict], checked: bool) -> None:
    """Each tool's parameters hold no keyword that cannot be enforced (a forced call is constrained
    by them) and, with `checked` (auto: calls are checked against them), compile to a JsonChecker."""
    for i, function in enumerate(functions.values()):
        try:
            if checked:
                json_checker(json.dumps(function["parameters"]))
            else:
                prepare(function["parameters"])
        except ValidationError as e:
            raise ToolError(f"tools[{i}].function.parameters", e.message) from None


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


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def _compact(text: str) -> str:
    return json.dumps(json.loads(text))


class ToolStream:
    """A streamed answer's text deltas as chat deltas: a named call's arguments as they come; the
    calls of `required` and `auto` once the answer is whole (auto streams its content until a
    <tool_call> could begin)."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of text sent as content (auto) or arguments (named)
        self.called = False

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        if self.tools.choice == "named":
            out = []
            if not self.called:
                self.called = True
                out.append({"tool_calls": [ToolCall(self.tools.named, "").openai(0)]})
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out
        if self.tools.choice == "required":
            return []
        start = self.text.find(CALL_START, self.sent)
        safe = start if start >= 0 else len(self.text) - _partial_marker(self.text)
        if safe <= self.sent:
            return []
        content, self.sent = self.text[self.sent:safe], safe
        return [{"content": content}]

    def finish(self) -> list[dict]:
        """The deltas once the answer is whole; `called` says whether it was a call."""
        if self.tools.choice == "named":
            return []
        if self.tools.choice == "required":
            content, calls = self.tools.parse(self.text)
            content = content or ""
        else:  # the content not sent yet: what the calls leave of the text after the first call could begin
            content, calls = self.tools.read_blocks(self.text)
            content = content[self.sent:] if calls else self.text[self.sent:]
        self.called = bool(calls)
        deltas = [{"content": content}] if content.strip() or (content and not calls) else []
        return deltas + [{"tool_calls": [call.openai(i)]} for i, call in enumerate(calls)]


def _partial_marker(text: str) -> int:
    """How many of text's last characters could begin a <tool_call> marker."""
    for n in range(min(len(CALL_START) - 1, len(text)), 0, -1):
        if CALL_START.startswith(text[-n:]):
            return n
    return 0
