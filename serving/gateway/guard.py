"""What a request to the OpenAI server must be before a handler sees it: a pure ASGI middleware,
which sees each request before its body is read and a streamed response until its last byte.

In order, each refusal in OpenAI's error shape and closing the connection (the body is not read on):
  401  an API key is set and the request lacks `Authorization: Bearer <key>` (every route but
       /health, which probes need, and the experiment page, which holds no data and fetches it
       with the key); compared in constant time, never echoed or logged.
  415  a POST whose Content-Type is not application/json. text/plain and form bodies are what any
       web page can make a browser send to another origin without a CORS preflight: refusing them
       keeps other sites' pages from driving this server through a visitor's browser.
  413  a Content-Length over `max_body_bytes`, at once.
  429  `max_concurrent_requests` requests already in flight (with Retry-After), or, for a read (any
       method but POST: the experiment's verdict, its page, /metrics), `max_concurrent_reads`
       reads. A request is in flight from its first body byte (a read: from its start) until its
       response's last, a streamed one included, so those admitted are unharmed and the memory
       held in bodies is bounded; reads take at most their own small share of the bound, so a
       flood of them leaves the rest to generation. /health and /v1/models are not counted: probes
       and clients finding the model need them, and their answers are constant.
  413  a chunked body that grows past `max_body_bytes`, as soon as it does.
  400  JSON nested deeper than MAX_JSON_DEPTH: counted over the raw bytes in one linear pass, since
       json.loads recurses once per level and fails on deep input (a RecursionError: a 500).
"""
from __future__ import annotations

import hmac
import re
from dataclasses import dataclass, field

import numpy as np
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.gateway.protocol import OpenAIError

API_KEY_ENV = "SPECSERVE_API_KEY"
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_CONCURRENT_REQUESTS = 256
DEFAULT_MAX_CONCURRENT_READS = 8  # each a handful of milliseconds: an operator's dashboards, probes of a canary
MAX_JSON_DEPTH = 64  # arrays and objects; an OpenAI request nests a handful deep
OPEN_PATHS = frozenset({"/health", "/experiment"})  # asked for no key
UNCOUNTED_PATHS = frozenset({"/health", "/v1/models"})  # not counted against the bound (constant answers)
RETRY_AFTER_S = 1
# a string (or one left open, to the end): possessive, so each byte is looked at once
JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?', re.S)
BRACKET_STEP = np.zeros(256, np.int8)  # byte -> change of nesting depth
BRACKET_STEP[list(b"[{")] = 1
BRACKET_STEP[list(b"]}")] = -1


@dataclass(frozen=True, slots=True)
class GuardConfig:
    api_key: str | None = field(default=None, repr=False)  # None: no key asked for
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    max_concurrent_reads: int = DEFAULT_MAX_CONCURRENT_READS  # of those, reads (not POSTs) at most

    def __post_init__(self):
        if self.api_key is not None and (not self.api_key or not self.api_key.isascii()
                                         or not self.api_key.isprintable() or " " in self.api_key):
            raise ValueError("the API key must be non-empty printable ASCII without spaces")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, not {self.max_body_bytes}")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests must be at least 1, not {self.max_concurrent_requests}")
        if self.max_concurrent_reads < 1:
            raise ValueError(f"max_concurrent_reads must be at least 1, not {self.max_concurrent_reads}")


def json_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in a JSON text: its brackets outside strings, each +1 or -1,
    and the running sum's maximum, in one linear pass whatever the input (valid JSON or not)."""
    brackets = np.frombuffer(JSON_STRING.sub(b"", raw), np.uint8)
    return int(np.cumsum(BRACKET_STEP[brackets], dtype=np.int64).max(initial=0))


class OpenAIGuard:
    """The middleware (`app.add_middleware(OpenAIGuard, config=...)`): the refusals above, in order."""

    def __init__(self, app: ASGIApp, config: GuardConfig):
        self.app, self.config = app, config
        self.bearer = None if config.api_key is None else config.api_key.encode()
        self.in_flight = 0  # requests between their first body byte (a read's start) and their response's last
        self.reads_in_flight = 0  # of those, reads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if (error := self._refusal(scope, Headers(scope=scope))) is not None:
            return await _refuse(error, scope, receive, send)
        read = scope["method"] != "POST"
        if read and scope["path"] in UNCOUNTED_PATHS:
            return await self.app(scope, receive, send)
        self.in_flight += 1
        self.reads_in_flight += read
        try:
            await (self.app(scope, receive, send) if read else self._forward(scope, receive, send))
        finally:
            self.in_flight -= 1
            self.reads_in_flight -= read

    def _refusal(self, scope: Scope, headers: Headers) -> OpenAIError | None:
        if self.bearer is not None and scope["path"] not in OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if not token:
                return OpenAIError("no API key: send it as `Authorization: Bearer <key>`", 401,
                                   code="invalid_api_key")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode("latin-1"), self.bearer):
                return OpenAIError("the API key is not valid", 401, code="invalid_api_key")
        if scope["method"] != "POST":
            full = self.reads_in_flight >= self.config.max_concurrent_reads
            return None if scope["path"] in UNCOUNTED_PATHS else self._busy(full)
        media_type, _, parameters = headers.get("content-type", "").partition(";")
        charset = parameters.strip().lower().removeprefix("charset=").strip('"')
        if media_type.strip().lower() != "application/json" or charset not in ("", "utf-8"):
            return OpenAIError("the body must be JSON: send `Content-Type: application/json`", 415)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.config.max_body_bytes:
            return _too_large(self.config.max_body_bytes)
        return self._busy(False)

    def _busy(self, reads_full: bool) -> OpenAIError | None:
        """A 429 when the bound is reached (or, for a read, the reads' share of it)."""
        if not reads_full and self.in_flight < self.config.max_concurrent_requests:
            return None
        count, what = (self.reads_in_flight, "reads") if reads_full else (self.in_flight, "requests")
        return OpenAIError(f"{count} {what} are in flight, the most this server takes; retry later",
                           429, kind="requests", code="rate_limit_exceeded")  # OpenAI's words for it

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body (bounded), check its nesting, and hand it on."""
        try:
            body = await _read_body(receive, self.config.max_body_bytes)
            if body is not None and json_depth(body) > MAX_JSON_DEPTH:
                raise OpenAIError(f"the JSON nests deeper than {MAX_JSON_DEPTH} arrays and objects")
        except OpenAIError as error:
            return await _refuse(error, scope, receive, send)
        if body is not None:  # None: the client left
            await self.app(scope, _replay(body, receive), send)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None if the client leaves first; a 413 once it grows past `limit`."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the client's own messages (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"the body is larger than {limit} bytes, the most this server reads", 413)


async def _refuse(error: OpenAIError, scope: Scope, receive: Receive, send: Send) -> None:
    headers = {"Connection": "close"}
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if error.status == 429:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)
