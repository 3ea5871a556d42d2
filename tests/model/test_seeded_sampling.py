"""Same seed, same tokens: a seeded request's output depends on its seed, its prompt and its
sampling parameters only. Everything the guarantee says must not matter is varied here (the
speculation method, k fixed, adaptive or 0, overlapped steps, prefix-cache hits, 0 to 59
batch-mates drawing from the engine's stream, the order of arrival) and nothing may move."""
from __future__ import annotations

import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams
from tests.model.test_eagle import write_eagle_head
from tests.model.test_engine_vs_hf import mixed_prompts

SEEDED = [
    dict(temperature=0.8, top_p=0.95, seed=1234),
    dict(temperature=1.0, seed=5),
    dict(temperature=0.7, top_k=20, min_p=0.05, seed=7),
    dict(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.3, seed=2**63 + 5),
    dict(temperature=1.0, min_tokens=8, seed=0),
]
MAX_TOKENS = 20


def generate(engine: LLMEngine, others: int = 0, reverse: bool = False) -> list[list[int]]:
    """The seeded requests' tokens, generated together with `others` unseeded sampled requests
    (interleaved with them), in reverse order of arrival when asked."""
    prompts, _ = mixed_prompts(len(SEEDED), seed=21)
    seeded = list(zip(prompts, SEEDED))
    others_prompts, _ = mixed_prompts(others, seed=others)
    order = [("s", i) for i in range(len(seeded))][:: -1 if reverse else 1]
    for j in range(others):
        order.insert((j * 7) % (len(order) + 1), ("o", j))
    ids: dict[int, str] = {}
    for kind, i in order:
        if kind == "s":
            prompt, knobs = seeded[i]
            ids[i] = engine.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **knobs))
        else:
            engine.add_request(others_prompts[i], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return [tokens[ids[i]] for i in range(len(seeded))]


def engine_of(model, **knobs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), **{"enable_prefix_caching": True, **knobs}))


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    """Each seeded request alone, without speculation."""
    out = []
    for i in range(len(SEEDED)):
        engine = engine_of(tiny_llama)
        prompts, _ = mixed_prompts(len(SEEDED), seed=21)
        rid = engine.add_request(prompts[i], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **SEEDED[i]))
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for o in engine.step() if o.request_id == rid for t in o.token_ids]
        out.append(tokens)
    return out


@pytest.mark.parametrize("name", [
    "plain", "plain-overlapped", "draft-k2", "draft-k4-self", "draft-adaptive", "draft-k3-overlapped",
    "ngram-k3", "suffix-k3", "suffix-adaptive", "eagle-k3", "eagle-adaptive",
])
def test_seeded_tokens_do_not_move(name, reference, tiny_llama, bad_draft, tmp_path_factory):
    """Together, beside 59 unseeded sampled requests (a batch of 64), in reverse order, and again on
    the same engine (every prompt a prefix-cache hit): the tokens of each request alone without
    speculation."""
    method, _, rest = name.partition("-")
    knobs: dict = {"async_scheduling": True} if rest.endswith("overlapped") else {}
    if method != "plain":
        knobs["speculative_method"] = method
        knobs["adaptive_speculation"] = "adaptive" in rest
        if not knobs["adaptive_speculation"]:
            knobs["num_speculative_tokens"] = int(rest.split("-")[0][1:])
        if method == "draft":
            knobs["draft_model"] = str(tiny_llama if "self" in rest else bad_draft)
        elif method == "eagle":
            knobs["draft_model"] = str(write_eagle_head(tiny_llama, tmp_path_factory.mktemp("eagle")))
    engine = engine_of(tiny_llama, **knobs)
    assert generate(engine) == reference
    assert generate(engine, others=59) == reference
    assert generate(engine, reverse=True) == reference
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens_total > 0
    if method != "plain":
        assert stats.spec_draft_tokens_total > 0
        if "self" in rest:  # the target as its own draft, with the same noise, agrees everywhere (but
            # where a draw sits on a tie that the two forwards' summation orders break differently)
            assert stats.spec_accepted_tokens_total >= 0.99 * stats.spec_draft_tokens_total
