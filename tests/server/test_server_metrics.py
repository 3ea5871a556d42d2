"""The engine's Prometheus families on Triton's metrics port count what was sent."""
from __future__ import annotations

import pytest

from client.stream import complete

pytestmark = pytest.mark.server

FAMILIES = [
    "specserve_num_requests_running",
    "specserve_num_requests_waiting",
    "specserve_kv_cache_usage_ratio",
    "specserve_kv_cache_free_blocks",
    "specserve_kv_cache_total_blocks",
    "specserve_prompt_tokens_total",
    "specserve_generation_tokens_total",
    "specserve_num_preemptions_total",
    "specserve_prefix_cache_hit_tokens_total",
    "specserve_prefix_cache_query_tokens_total",
    "specserve_spec_decode_draft_tokens_total",
    "specserve_spec_decode_accepted_tokens_total",
    'specserve_request_success_total{finish_reason="stop"}',
    'specserve_request_success_total{finish_reason="length"}',
    "specserve_time_to_first_token_seconds_count",
    "specserve_inter_token_latency_seconds_count",
    "specserve_e2e_request_latency_seconds_count",
    "specserve_request_queue_time_seconds_count",
]


def _settled(server):
    return server.wait_for_metrics(lambda s: s["specserve_num_requests_running"] == 0)


def test_families_are_exported(server):
    samples = server.metrics()
    missing = [name for name in FAMILIES if name not in samples]
    assert not missing
    assert samples["specserve_kv_cache_total_blocks"] > 0
    assert 0.0 <= samples["specserve_kv_cache_usage_ratio"] <= 1.0


def test_counts_match_the_requests_sent(server, tokenizer):
    prompts = ["The sun rose over the hills", "A quiet village", "Three small birds"]
    max_tokens = [5, 7, 11]
    before = _settled(server)
    for prompt, n in zip(prompts, max_tokens):
        complete(server.grpc_url, prompt, max_tokens=n, temperature=0.0, ignore_eos=True)
    after = server.wait_for_metrics(
        lambda s: s["specserve_e2e_request_latency_seconds_count"]
        >= before["specserve_e2e_request_latency_seconds_count"] + len(prompts)
    )

    def delta(name):
        return after[name] - before[name]

    length = 'specserve_request_success_total{finish_reason="length"}'
    assert delta(length) == len(prompts)
    assert delta("specserve_generation_tokens_total") == sum(max_tokens)
    num_prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert delta("specserve_prompt_tokens_total") == num_prompt_tokens
    assert delta("specserve_prefix_cache_query_tokens_total") >= 0
    assert delta("specserve_time_to_first_token_seconds_count") == len(prompts)
    assert delta("specserve_request_queue_time_seconds_count") == len(prompts)
    assert delta("specserve_inter_token_latency_seconds_count") == sum(max_tokens) - len(prompts)
    assert delta("specserve_e2e_request_latency_seconds_count") == len(prompts)
    assert after["specserve_time_to_first_token_seconds_sum"] > before["specserve_time_to_first_token_seconds_sum"]


def test_a_prompt_sent_again_reuses_all_but_its_last_token(server, tokenizer):
    """Served, the same prompt again reuses its cache token by token: every prompt token but the
    last (which gives the logits) is a hit, whole blocks and then the head of the block the first
    answer filled (copied), and the greedy answer is the same."""
    prompt = "Once upon a time, in a village between two rivers, a small robot learned to paint"
    num_prompt_tokens = len(tokenizer(prompt)["input_ids"])
    assert num_prompt_tokens % 16 > 1  # its tail is a shared head: whole blocks alone would reuse fewer
    first = complete(server.grpc_url, prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
    before = _settled(server)
    second = complete(server.grpc_url, prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
    after = server.wait_for_metrics(
        lambda s: s["specserve_e2e_request_latency_seconds_count"]
        >= before["specserve_e2e_request_latency_seconds_count"] + 1
    )
    hits = after["specserve_prefix_cache_hit_tokens_total"] - before["specserve_prefix_cache_hit_tokens_total"]
    queried = after["specserve_prefix_cache_query_tokens_total"] - before["specserve_prefix_cache_query_tokens_total"]
    assert (queried, hits) == (num_prompt_tokens, num_prompt_tokens - 1)
    assert second.text == first.text and len(first.chunks) > 0
