"""Attacks on the OpenAI-compatible server (serving/gateway/server.py, serving/gateway/guard.py), each
of which must fail, against the real tritonserver: no or a wrong API key, a 10 MB body (declared
or chunked), 100,000 `[`, a text/plain body such as any web page can have a browser send, and a
flood past the bound on requests in flight that leaves those in flight whole."""
from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.server.conftest import openai_server

pytestmark = pytest.mark.server
KEY = "sk-specserve-test-4f1c9a"
AUTHORIZATION = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"} | AUTHORIZATION
COMPLETION = {"model": "specserve", "prompt": "x", "max_tokens": 1}
LONG = 300  # tokens of each held stream: long enough to outlast the flood


@pytest.fixture(scope="module")
def api(server):
    with openai_server(server, env={"SPECSERVE_API_KEY": KEY}, secret=KEY) as base:
        yield base


def send(base: str, body: bytes, headers: dict[str, str], path: str = "/v1/completions",
         method: str = "POST") -> tuple[int, dict]:
    """One raw request (no header added for us): its status and JSON body."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request(method, path, body, headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_no_key_is_401_in_openais_shape(api):
    for method, path, body in [("POST", "/v1/completions", json.dumps(COMPLETION).encode()),
                               ("POST", "/v1/chat/completions", b"{}"), ("GET", "/v1/models", None)]:
        status, error = send(api, body, {"Content-Type": "application/json"}, path, method)
        assert status == 401
        assert error["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                   "param": None, "code": "invalid_api_key"}


def test_a_wrong_key_is_401_and_not_echoed(api):
    wrong = "sk-wrong-key-7d2b"
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{api}/v1", api_key=wrong).completions.create(**COMPLETION)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert wrong not in e.value.response.text and KEY not in e.value.response.text
    status, _ = send(api, json.dumps(COMPLETION).encode(), {"Content-Type": "application/json",
                                                           "Authorization": f"Bearer {KEY}x"})
    assert status == 401


def test_the_right_key_works_with_the_openai_client(api):
    client = openai.OpenAI(base_url=f"{api}/v1", api_key=KEY)
    assert [m.id for m in client.models.list()] == ["specserve"]
    reply = client.completions.create(model="specserve", prompt="def ", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4 and reply.choices[0].text
    chat = client.chat.completions.create(model="specserve", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 4


def test_health_needs_no_key(api):
    assert urllib.request.urlopen(f"{api}/health", timeout=10).status == 200


def test_a_10mb_body_is_413_before_it_is_sent(api):
    host, port = api.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.putrequest("POST", "/v1/completions")
    for name, value in (JSON | {"Content-Length": str(10_000_000)}).items():
        connection.putheader(name, value)
    connection.endheaders()  # the headers only: the answer must not wait for the body
    response = connection.getresponse()
    assert response.status == 413
    assert "1048576 bytes" in json.loads(response.read())["error"]["message"]
    connection.close()


def test_a_chunked_body_is_413_as_soon_as_it_passes_the_limit(api):
    host, port = api.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.putrequest("POST", "/v1/completions")
    for name, value in (JSON | {"Transfer-Encoding": "chunked"}).items():
        connection.putheader(name, value)
    connection.endheaders()
    chunk = b" " * 65536
    for _ in range(16):  # 1 MiB, the limit: still read on
        connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    connection.send(b"1\r\n \r\n")  # one byte past it, and the body never ends
    response = connection.getresponse()
    assert response.status == 413 and response.getheader("Connection") == "close"
    connection.close()


def test_deep_nesting_is_400_not_500(api):
    status, error = send(api, b"[" * 100_000, JSON)
    assert status == 400 and "deeper than 64" in error["error"]["message"]
    assert error["error"]["type"] == "invalid_request_error"
    assert send(api, b"{bad", JSON)[0] == 400


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_that_is_not_declared_json_is_415(api, content_type):
    headers = AUTHORIZATION | ({"Content-Type": content_type} if content_type else {})
    status, error = send(api, json.dumps(COMPLETION).encode(), headers)
    assert status == 415 and "application/json" in error["error"]["message"]


def test_json_with_a_charset_is_accepted(api):
    headers = JSON | {"Content-Type": "application/json; charset=utf-8"}
    status, reply = send(api, json.dumps(COMPLETION).encode(), headers)
    assert status == 200 and reply["usage"]["completion_tokens"] == 1


def test_a_flood_past_the_bound_is_429_and_those_in_flight_finish(server):
    # the flag wins over the environment variable
    with openai_server(server, "--max-concurrent-requests", "2", "--api-key", KEY, secret=KEY,
                       env={"SPECSERVE_API_KEY": "sk-other"}) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        held = [client.completions.create(model="specserve", prompt="Once upon a time", max_tokens=LONG, stream=True,
                                          stream_options={"include_usage": True}, temperature=0,
                                          extra_body={"ignore_eos": True}) for _ in range(2)]
        firsts = [next(iter(stream)) for stream in held]  # both are in flight, their handlers returned
        for _ in range(3):
            with pytest.raises(openai.RateLimitError) as e:
                client.chat.completions.create(model="specserve", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=1)
            assert e.value.status_code == 429 and e.value.response.headers["Retry-After"] == "1"
            assert e.value.code == "rate_limit_exceeded"
        assert [m.id for m in client.models.list()] == ["specserve"]  # only generation requests count
        for first, stream in zip(firsts, held):
            chunks = [first, *stream]
            assert chunks[-1].usage.completion_tokens == LONG
            finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert finish_reasons == ["length"]
        # the two have ended: a new one gets in (the official client retries after Retry-After)
        again = client.with_options(max_retries=3).completions.create(**COMPLETION)
        assert again.usage.completion_tokens == 1


def test_a_client_that_leaves_frees_its_place(server):
    with openai_server(server, "--max-concurrent-requests", "1", env={"SPECSERVE_API_KEY": KEY}, secret=KEY) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        stream = client.completions.create(model="specserve", prompt="Once upon a time", max_tokens=1500,
                                           stream=True, temperature=0, extra_body={"ignore_eos": True})
        next(iter(stream))
        with pytest.raises(openai.RateLimitError):
            client.completions.create(**COMPLETION)
        stream.close()
        again = client.with_options(max_retries=3).completions.create(**COMPLETION)
        assert again.usage.completion_tokens == 1
