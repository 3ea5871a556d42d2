"""OpenAI's response bodies and stream chunks for one generation, completions or chat, with logprobs,
tool calls and usage.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from serving.gateway.protocol import Accumulator, GenerationRequest, chat_logprobs, completion_logprobs
from serving.gateway.tool_stream import ToolStream


class Reply:
    """The OpenAI objects of one request: whole completions, stream chunks, the usage chunk."""

    def __init__(self, kind: str, model: str, request: GenerationRequest):
        self.kind, self.model, self.request = kind, model, request
        self.id = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tool_stream = ToolStream(request.tools) if request.tools is not None else None

    def _base(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def whole(self, gathered: Accumulator) -> dict:
        text = "".join(gathered.text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": gathered.finish_reason or "stop"}
        if self.kind == "chat.completion":
            choice["message"] = {"role": "assistant", "content": text}
            if self.request.tools is not None:
                content, calls = self.request.tools.parse(text)
                if calls:
                    choice["message"] = {"role": "assistant", "content": content,
                                         "tool_calls": [call.openai() for call in calls]}
                    if choice["finish_reason"] == "stop":
                        choice["finish_reason"] = "tool_calls"
            choice["logprobs"] = self._chat_logprobs(gathered.logprobs)
        else:
            prefix = self.request.echo_prompt or ""
            choice["text"] = prefix + text
            choice["logprobs"] = self._completion_logprobs(gathered.logprobs, len(prefix))
        return self._base(self.kind) | {"choices": [choice], "usage": gathered.usage()}

    def chunk(self, delta=None, offset: int = 0, role: bool = False) -> dict:
        text = "" if delta is None else delta.text
        finish = None if delta is None else delta.finish_reason
        logprobs = [] if delta is None else delta.logprobs
        if self.kind == "chat.completion":
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""} if role else {"content": text},
                      "logprobs": self._chat_logprobs(logprobs) if logprobs else None, "finish_reason": finish}
            return self._base("chat.completion.chunk") | {"choices": [choice]}
        if role:
            text = self.request.echo_prompt or ""
        choice = {"index": 0, "text": text, "finish_reason": finish,
                  "logprobs": self._completion_logprobs(logprobs, offset) if logprobs else None}
        return self._base("text_completion") | {"choices": [choice]}

    def tool_chunks(self, delta) -> list[dict]:
        """A response's chunks when the answer may be a tool call (serving/gateway/tool_calls.py)."""
        stream = self.tool_stream
        deltas = stream.feed(delta.text)
        if delta.finish_reason:
            deltas += stream.finish()
        chunks = [self._chat_chunk(d, None, self._chat_logprobs(delta.logprobs) if i == 0 and delta.logprobs else None)
                  for i, d in enumerate(deltas)]
        if delta.finish_reason:
            finish = "tool_calls" if stream.called and delta.finish_reason == "stop" else delta.finish_reason
            chunks.append(self._chat_chunk({}, finish, None))
        return chunks

    def _chat_chunk(self, message_delta: dict, finish: str | None, logprobs: dict | None) -> dict:
        choice = {"index": 0, "delta": message_delta, "logprobs": logprobs, "finish_reason": finish}
        return self._base("chat.completion.chunk") | {"choices": [choice]}

    def usage_chunk(self, gathered: Accumulator) -> dict:
        object_name = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        return self._base(object_name) | {"choices": [], "usage": gathered.usage()}

    def _chat_logprobs(self, entries: list[dict]) -> dict | None:
        return None if self.request.logprobs is None else chat_logprobs(entries, self.request.logprobs)

    def _completion_logprobs(self, entries: list[dict], offset: int) -> dict | None:
        return None if self.request.logprobs is None else completion_logprobs(entries, self.request.logprobs, offset)
