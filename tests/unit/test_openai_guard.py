"""serving/gateway/guard.py as plain ASGI: the nesting count, and each refusal decided before the
handler runs (and before more of the body is read than the limit)."""
from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from serving.gateway.guard import MAX_JSON_DEPTH, GuardConfig, OpenAIGuard, json_depth

KEY = "sk-test-0123456789"
JSON = [(b"content-type", b"application/json")]


@pytest.mark.parametrize("text,depth", [
    (b"", 0), (b"1", 0), (b"{}", 1), (b"[[]]", 2), (b'[{"x": [1]}]', 3), (b'"[[["', 0),
    (b'{"a": "]]]]"}', 1), (b'{"a": "\\\\"}', 1), (b'{"a": "\\"[["}', 1), (b'[["\\\\"], [[{}]]]', 4),
    (b'"open [[[', 0), (b"[" * 100_000, 100_000),
])
def test_json_depth_counts_brackets_outside_strings(text, depth):
    assert json_depth(text) == depth


def nesting(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(nesting, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    return 0


JSON_TEXT = st.text(alphabet=st.sampled_from('ab"\\[]{}\n\u00e9'))
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | JSON_TEXT,
                           lambda inner: st.lists(inner) | st.dictionaries(JSON_TEXT, inner), max_leaves=30)


@given(JSON_VALUES, st.booleans())
def test_json_depth_agrees_with_the_parsed_value(value, ascii_only):
    assert json_depth(json.dumps(value, ensure_ascii=ascii_only).encode()) == nesting(value)


class Handler:
    """The app behind the guard: reads the whole body, then answers 200 (a POST after `release`, if set)."""

    def __init__(self, release: asyncio.Event | None = None):
        self.bodies: list[bytes] = []
        self.release = release

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.bodies.append(body)
        if self.release is not None and scope["method"] == "POST":
            await self.release.wait()
        await JSONResponse({"ok": True})(scope, receive, send)


async def call(guard: OpenAIGuard, headers=JSON, chunks=(b"{}",), method="POST", path="/v1/completions"):
    """(status, headers, body, how many body chunks the guard read)."""
    messages = [{"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)} for i, c in enumerate(chunks)]
    read = 0
    sent: list[dict] = []

    async def receive():
        nonlocal read
        if read < len(messages):
            read += 1
            return messages[read - 1]
        await asyncio.Event().wait()  # the client stays

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": list(headers), "query_string": b""}
    await guard(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), json.loads(body), read


def guarded(**config) -> tuple[OpenAIGuard, Handler]:
    handler = Handler()
    return OpenAIGuard(handler, GuardConfig(**config)), handler


@pytest.mark.parametrize("authorization,status", [
    (None, 401), (b"Bearer wrong", 401), (b"Basic " + KEY.encode(), 401), (b"Bearer", 401),
    (b"Bearer " + KEY.encode(), 200), (b"bearer " + KEY.encode(), 200),
])
def test_the_api_key(authorization, status):
    guard, handler = guarded(api_key=KEY)
    headers = JSON + ([(b"authorization", authorization)] if authorization else [])
    got, response_headers, body, _ = asyncio.run(call(guard, headers))
    assert got == status and len(handler.bodies) == (status == 200)
    if status == 401:
        assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
        assert KEY not in json.dumps(body) and response_headers[b"www-authenticate"] == b"Bearer"


def test_health_and_the_experiment_page_need_no_key_and_the_data_does():
    guard, _ = guarded(api_key=KEY)
    assert asyncio.run(call(guard, [], (b"",), "GET", "/health"))[0] == 200
    assert asyncio.run(call(guard, [], (b"",), "GET", "/experiment"))[0] == 200
    for path in ("/v1/models", "/v1/experiment", "/v1/experiment/ecdf", "/metrics"):
        assert asyncio.run(call(guard, [], (b"",), "GET", path))[0] == 401


@pytest.mark.parametrize("content_type,status", [
    (None, 415), (b"text/plain", 415), (b"application/x-www-form-urlencoded", 415), (b"multipart/form-data", 415),
    (b"application/json; charset=latin-1", 415), (b"application/json", 200),
    (b"application/json; charset=utf-8", 200), (b"Application/JSON;charset=UTF-8", 200),
])
def test_only_json_bodies(content_type, status):
    guard, handler = guarded()
    headers = [(b"content-type", content_type)] if content_type else []
    assert asyncio.run(call(guard, headers))[0] == status
    assert len(handler.bodies) == (status == 200)


def test_a_content_length_over_the_limit_is_413_before_any_of_the_body_is_read():
    guard, handler = guarded(max_body_bytes=100)
    status, headers, body, read = asyncio.run(call(guard, JSON + [(b"content-length", b"101")], (b"x" * 101,)))
    assert (status, read, handler.bodies) == (413, 0, [])
    assert headers[b"connection"] == b"close" and "100 bytes" in body["error"]["message"]


def test_a_chunked_body_is_413_as_soon_as_it_grows_past_the_limit():
    guard, handler = guarded(max_body_bytes=100)
    status, _, _, read = asyncio.run(call(guard, JSON, [b"x" * 40] * 10))
    assert (status, read, handler.bodies) == (413, 3, [])  # 120 bytes > 100: the 4th chunk is never asked for


def test_a_body_at_the_limit_reaches_the_handler_whole():
    guard, handler = guarded(max_body_bytes=100)
    chunks = [b'{"prompt": "', b"x" * 86, b'"}']
    assert asyncio.run(call(guard, JSON, chunks))[0] == 200
    assert handler.bodies == [b"".join(chunks)]


def test_nesting_past_the_bound_is_400():
    guard, handler = guarded()
    ok = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert asyncio.run(call(guard, JSON, (ok,)))[0] == 200
    status, _, body, _ = asyncio.run(call(guard, JSON, (b"[" + ok + b"]",)))
    assert status == 400 and "deeper than 64" in body["error"]["message"]
    assert handler.bodies == [ok]


def test_requests_past_the_bound_get_429_and_those_in_flight_finish():
    async def flood():
        release = asyncio.Event()
        handler = Handler(release)
        guard = OpenAIGuard(handler, GuardConfig(max_concurrent_requests=2))
        held = [asyncio.create_task(call(guard)) for _ in range(2)]
        await asyncio.sleep(0.01)
        refused = await call(guard)
        gets = await call(guard, [], (b"",), "GET", "/v1/experiment")  # reads count too
        health = await call(guard, [], (b"",), "GET", "/health")  # but not the probes'
        release.set()
        finished = await asyncio.gather(*held)
        return refused, gets, health, finished, guard.in_flight, await call(guard)

    (status, headers, body, _), gets, health, finished, in_flight, after = asyncio.run(flood())
    assert status == 429 and headers[b"retry-after"] == b"1"
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert gets[0] == 429 and health[0] == 200
    assert [f[0] for f in finished] == [200, 200] and in_flight == 0 and after[0] == 200


class SlowReads(Handler):
    """Reads wait for `release`; POSTs are answered at once."""

    async def __call__(self, scope, receive, send):
        if scope["method"] != "POST":
            await self.release.wait()
        await JSONResponse({"ok": True})(scope, receive, send)


def test_reads_take_their_share_of_the_bound_and_generation_keeps_the_rest():
    """Reads held open past their share get a 429; POSTs are served up to the bound beside them."""
    async def flood():
        handler = SlowReads(asyncio.Event())
        guard = OpenAIGuard(handler, GuardConfig(max_concurrent_requests=5, max_concurrent_reads=2))
        reads = [asyncio.create_task(call(guard, [], (b"",), "GET", "/v1/experiment")) for _ in range(10)]
        await asyncio.sleep(0.01)
        held = guard.in_flight, guard.reads_in_flight
        posts = await asyncio.gather(*(call(guard) for _ in range(3)))
        handler.release.set()
        return held, posts, await asyncio.gather(*reads), guard.in_flight

    (in_flight, reads_in_flight), posts, reads, after = asyncio.run(flood())
    assert (in_flight, reads_in_flight) == (2, 2) and after == 0
    assert [p[0] for p in posts] == [200, 200, 200]
    assert sorted(r[0] for r in reads) == [200] * 2 + [429] * 8
    assert "2 reads are in flight" in next(r for r in reads if r[0] == 429)[2]["error"]["message"]


@pytest.mark.parametrize("config", [dict(api_key=""), dict(api_key="a b"), dict(max_body_bytes=0),
                                    dict(max_concurrent_requests=0), dict(max_concurrent_reads=0)])
def test_bad_configs_are_refused(config):
    with pytest.raises(ValueError):
        GuardConfig(**config)


def test_the_key_is_not_in_the_config_repr():
    assert KEY not in repr(GuardConfig(api_key=KEY))
