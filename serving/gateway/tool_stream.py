"""A streamed answer that may hold tool calls, as OpenAI's chat deltas: content as it comes, each
call as `tool_calls[i]` deltas (the first with index, id, type and function.name, then
function.arguments fragments).

    named      the call's name at once, its arguments as the model writes them
    required   each call's name once written, its arguments as the model writes them
               (serving/gateway/tool_parsers.py's CallArrayReader)
    auto       content as it comes; each call once its block is whole and checked against the
               tool's parameters (a call that fails is content, so it cannot be sent before it
               is read through), name then arguments

What a stream sends adds up to the whole answer's message (Tools.parse) for the same text:
forced calls are read by the same reader, and `auto` answers are read by the same scan, whose
decided part never changes as the text grows.
"""
from __future__ import annotations

from serving.gateway.tool_calls import ToolCall, Tools
from serving.gateway.tool_parsers import CallArrayReader


class ToolStream:
    def __init__(self, tools: Tools):
        self.tools = tools
        self.text = ""
        self.reader = CallArrayReader() if tools.choice == "required" else None
        self.blocks: dict[int, tuple[list[ToolCall], str]] = {}  # auto: each block's reading, by its start
        self.memo: dict[int, tuple] = {}  # auto: where each open block's JSON was left (tool_parsers.json_end)
        self.content_sent = 0  # characters of content sent
        self.calls: list[ToolCall] = []  # calls begun
        self.arguments_sent: list[int] = []  # characters of each call's arguments sent
        self.called = False  # the answer holds a call

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        if self.reader is not None:
            self.reader.feed(delta)
        return self._deltas(final=False)

    def finish(self) -> list[dict]:
        """The deltas once the answer is whole."""
        return self._deltas(final=True)

    def _deltas(self, final: bool) -> list[dict]:
        if self.tools.forced:
            calls = self.tools.forced_calls(self.text, self.reader)
            content = self.text if final and not calls else ""
        else:
            content, calls = self.tools.read(self.text, final, self.blocks, self.memo)
            if not content.strip() and not (final and not calls):
                content = ""  # whitespace alone is sent once something follows it
        out = [{"content": content[self.content_sent:]}] if len(content) > self.content_sent else []
        self.content_sent = max(self.content_sent, len(content))
        for i, call in enumerate(calls):
            if i == len(self.calls):
                self.calls.append(call)
                self.arguments_sent.append(0)
                out.append({"tool_calls": [ToolCall(call.name, "", self.calls[i].id).openai(i)]})
            if len(call.arguments) > self.arguments_sent[i]:
                fragment = call.arguments[self.arguments_sent[i]:]
                out.append({"tool_calls": [{"index": i, "function": {"arguments": fragment}}]})
                self.arguments_sent[i] = len(call.arguments)
        self.called = bool(self.calls)
        return out
