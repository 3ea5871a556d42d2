"""Generation through `llm`: gRPC stream, HTTP SSE and single responses agree; `llm_bls` too."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from client.stream import GenerationError, complete

pytestmark = pytest.mark.server

PROMPT = "Once upon a time, a little robot"
PROTOCOLS = [("grpc", True), ("grpc", False), ("http", True), ("http", False)]


def _run(server, protocol: str, stream: bool, prompt: str = PROMPT, **params):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    return complete(url, prompt, protocol=protocol, stream=stream, **params)


@pytest.mark.parametrize(
    "params",
    [
        dict(max_tokens=24, temperature=0.0, ignore_eos=True),
        dict(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_every_protocol_gives_the_same_text(server, params):
    results = {(p, s): _run(server, p, s, **params) for p, s in PROTOCOLS}
    texts = {key: r.text for key, r in results.items()}
    assert len(set(texts.values())) == 1, texts
    assert texts[("grpc", True)]
    streamed = results[("grpc", True)]
    assert len(streamed.chunks) > 1  # deltas, not one response
    assert "".join(c.text for c in streamed.chunks) == results[("grpc", False)].text


def test_llm_bls_streams_the_same_text_as_llm(server):
    params = dict(max_tokens=24, temperature=0.0, ignore_eos=True, return_finish_reason=True)
    via_llm = _run(server, "grpc", True, **params)
    via_bls = _run(server, "grpc", True, model="llm_bls", **params)
    assert [c.text for c in via_bls.chunks] == [c.text for c in via_llm.chunks]
    assert via_bls.finish_reason == via_llm.finish_reason == "length"


def test_seed_decides_sampled_text(server):
    params = dict(max_tokens=24, temperature=1.0, ignore_eos=True)
    first = _run(server, "grpc", True, seed=1, **params).text
    assert _run(server, "grpc", True, seed=1, **params).text == first
    assert _run(server, "grpc", True, seed=2, **params).text != first


@pytest.mark.parametrize("protocol,stream", PROTOCOLS)
def test_token_counts_and_finish_reason(server, tokenizer, protocol, stream):
    result = _run(
        server, protocol, stream, max_tokens=9, temperature=0.0, ignore_eos=True,
        return_finish_reason=True, return_num_input_tokens=True, return_num_output_tokens=True,
        return_logprobs=True, return_cumulative_logprob=True, sampling_parameters={"logprobs": 2},
    )
    last = result.chunks[-1]
    assert last.finish_reason == "length"
    assert all(c.finish_reason is None for c in result.chunks[:-1])  # "None" on the wire
    assert last.num_input_tokens == len(tokenizer(PROMPT)["input_ids"])
    assert result.num_output_tokens == 9  # each chunk counts its own tokens
    logprobs = [lp for c in result.chunks for lp in (c.logprobs or [])]
    assert len(logprobs) == 9
    for c in result.chunks:
        assert len(c.logprobs) == c.num_output_tokens
        assert c.text == "".join(d["decoded_token"] for lp in c.logprobs for d in lp.values() if d["rank"] == 1)
    for lp in logprobs:  # greedy: the chosen token ranks first, beside the top 2
        assert 1 <= len(lp) <= 3 and all(d["logprob"] <= 0.0 for d in lp.values())
        assert sorted(d["rank"] for d in lp.values())[:2] == [1, 2]
    total = sum(d["logprob"] for lp in logprobs for d in lp.values() if d["rank"] == 1)
    assert last.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_the_prompt_is_echoed_as_vllm_backend_does(server):
    """Without exclude_input_in_output a whole completion follows the prompt and a stream does
    not; false with streaming is refused. (The client library excludes it unless asked.)"""
    params = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = _run(server, "grpc", True, **params).text
    assert _run(server, "grpc", True, exclude_input_in_output=None, **params).text == plain
    assert _run(server, "http", False, exclude_input_in_output=None, **params).text == PROMPT + plain
    assert _run(server, "grpc", False, exclude_input_in_output=False, **params).text == PROMPT + plain
    assert _run(server, "grpc", False, **params).text == plain
    with pytest.raises(GenerationError, match="exclude_input_in_output: false is not allowed when streaming"):
        _run(server, "grpc", True, exclude_input_in_output=False, **params)


def test_sampling_parameters_json_matches_single_inputs(server):
    single = _run(server, "grpc", True, max_tokens=12, temperature=0.7, seed=3, ignore_eos=True)
    as_json = _run(
        server, "grpc", True,
        sampling_parameters={"max_tokens": 12, "temperature": "0.7", "seed": 3, "ignore_eos": True},
    )
    assert as_json.text == single.text


def test_stop_string_ends_the_text(server):
    full = _run(server, "grpc", False, max_tokens=32, temperature=0.0, ignore_eos=True).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"cannot pick a stop string from {full!r}"
    cut = _run(
        server, "grpc", True, max_tokens=32, temperature=0.0, ignore_eos=True, stop=[stop],
        return_finish_reason=True,
    )
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop"


def test_chat_messages_use_the_chat_template(server, tokenizer):
    messages = [{"role": "user", "content": "Tell me a story."}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    params = dict(max_tokens=10, temperature=0.0, ignore_eos=True, return_num_input_tokens=True)
    chat = complete(server.grpc_url, messages=messages, **params)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert chat.chunks[-1].num_input_tokens == len(ids)
    as_json = complete(server.grpc_url, messages=json.dumps(messages), **params)
    assert as_json.text == chat.text


def test_concurrent_streams_match_their_solo_text(server):
    requests = [
        (f"Story {i}: the {['cat', 'dog', 'owl', 'fox'][i % 4]} " + "and then " * (i % 5), 4 + 3 * i % 29)
        for i in range(32)
    ]
    params = dict(temperature=0.0, ignore_eos=True, return_num_output_tokens=True)
    solo = [_run(server, "grpc", True, p, max_tokens=n, **params) for p, n in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(
            pool.map(lambda r: _run(server, "grpc", True, r[0], max_tokens=r[1], **params), requests)
        )
    for (prompt, n), alone, batched in zip(requests, solo, together):
        assert batched.text == alone.text, prompt
        assert batched.num_output_tokens == n
