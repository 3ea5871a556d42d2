"""The OpenAI-compatible server (serving/gateway/server.py) with the official `openai` client,
against the real tritonserver: models, chat and completions streamed and whole, usage, stop, seeds,
logprobs, OpenAI-shaped errors, and a client that leaves mid-stream freeing its KV cache."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.server.conftest import idle, openai_server

pytestmark = pytest.mark.server
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def api(server):
    with openai_server(server) as base:
        yield base


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=f"{api}/v1", api_key="unused")


def test_models(client):
    assert [m.id for m in client.models.list()] == ["specserve"]


def test_chat_whole_and_streamed_agree(client):
    messages = [{"role": "user", "content": "Write a Python function."}]
    whole = client.chat.completions.create(model="specserve", messages=messages, **GREEDY)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(model="specserve", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_completions_with_stop_echo_and_seed(client):
    plain = client.completions.create(model="specserve", prompt="import os\n", **GREEDY).choices[0].text
    stop = plain.strip().split()[1] if len(plain.split()) > 1 else plain[-2:]
    cut = client.completions.create(model="specserve", prompt="import os\n", stop=[stop], **GREEDY).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and plain.startswith(cut.text)
    echoed = client.completions.create(model="specserve", prompt="import os\n", echo=True, **GREEDY)
    assert echoed.choices[0].text == "import os\n" + plain
    sampled = [client.completions.create(model="specserve", prompt="def ", max_tokens=16, temperature=1.0,
                                         seed=seed).choices[0].text for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_logprobs(client):
    reply = client.chat.completions.create(model="specserve", messages=[{"role": "user", "content": "hi"}],
                                           logprobs=True, top_logprobs=2, **GREEDY)
    content = reply.choices[0].logprobs.content
    assert len(content) == 12
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)


@pytest.mark.parametrize("body,param", [
    ({"temperature": "hot"}, "temperature"), ({"n": 2}, "n"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"extra_body": {"top_k": "x"}}, "top_k"),
])
def test_bad_requests_get_openai_errors(client, body, param):
    extra = body.pop("extra_body", None)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="specserve", prompt="x", extra_body=extra or body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")


def test_leaving_a_stream_frees_the_kv_within_a_second(api, server):
    server.wait_for_metrics(idle)
    body = {"model": "specserve", "prompt": "Once upon a time", "max_tokens": 1500, "stream": True,
            "ignore_eos": True, "temperature": 0}
    request = urllib.request.Request(f"{api}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        seen = [response.readline().decode() for _ in range(6)]
        assert any(json.loads(line[6:])["choices"][0]["text"] for line in seen if line.startswith("data: {"))
    after = server.wait_for_metrics(idle, timeout=1.0)  # the connection is closed: stopped on the server
    assert idle(after)
