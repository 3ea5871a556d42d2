"""Speculative decoding: greedy output identical to plain decoding, sampling lossless,
blocks accounted for after rejections, aborts and preemptions."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from backend.config import EngineConfig
from backend.core.request import Request
from backend.engine import LLMEngine
from backend.errors import ValidationError
from backend.model.model_loader import DRAFT_VOCAB_FILE, EMBEDDINGS
from backend.sample.sampler import PLACEHOLDER_TOKEN, Sampler, probs_from_logits
from backend.sample.sampling_metadata import build_sampling_metadata
from backend.sampling_params import SamplingParams
from tests.conftest import write_tiny_model
from tests.model.test_engine_vs_hf import mixed_prompts, run_engine


def reduce_draft_vocabulary(draft: Path, out: Path, token_ids: list[int], drop_embeddings: bool) -> Path:
    """A copy of `draft` whose lm_head keeps the rows of `token_ids` only (DRAFT_VOCAB_FILE says
    which), without its embeddings when asked (it then reads the target's)."""
    shutil.copytree(draft, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"][token_ids].contiguous()
    if drop_embeddings:
        del weights[EMBEDDINGS]
    save_file(weights, str(out / "model.safetensors"))
    save_file({"token_ids": torch.tensor(token_ids, dtype=torch.int64)}, str(out / DRAFT_VOCAB_FILE))
    return out


def spec_engine(model, draft=None, method="draft", **knobs) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model), speculative_method=method, draft_model=str(draft) if draft else None, **knobs
    ))


@pytest.mark.parametrize(
    "which,knobs",
    [
        ("bad", {}),
        ("perfect", {}),
        ("ngram", {}),
        ("suffix", {}),
        ("suffix", {"num_kv_blocks": 24, "block_size": 8}),  # preemption forced
        ("bad", {"num_kv_blocks": 24, "block_size": 8}),  # preemption forced
        ("perfect", {"max_num_batched_tokens": 30, "num_speculative_tokens": 6}),  # budget cuts k
        # overlapped steps: each step's drafts are proposed from the last step's tokens on the device
        ("bad", {"async_scheduling": True}),
        ("perfect", {"async_scheduling": True}),
        ("bad", {"num_kv_blocks": 24, "block_size": 8, "async_scheduling": True}),
        ("perfect", {"max_num_batched_tokens": 30, "num_speculative_tokens": 6, "async_scheduling": True}),
    ],
)
def test_greedy_identical_to_plain_decoding(which, knobs, tiny_llama, bad_draft):
    prompts, max_tokens = mixed_prompts(32, seed=3)
    prompts = [p + p[:8] * 2 for p in prompts]  # some repetition for the n-gram proposer
    plain = run_engine(LLMEngine(EngineConfig(model=str(tiny_llama))), prompts, max_tokens)
    draft = {"bad": bad_draft, "perfect": tiny_llama, "ngram": None, "suffix": None}[which]
    engine = spec_engine(tiny_llama, draft, which if which in ("ngram", "suffix") else "draft",
                         adaptive_speculation=False, **knobs)
    assert run_engine(engine, prompts, max_tokens) == plain  # also checks free == total blocks
    stats = engine.stats()
    assert stats.spec_draft_tokens_total > 0
    if which == "perfect":  # the target as its own draft: every token accepted
        assert stats.spec_accepted_tokens_total == stats.spec_draft_tokens_total
    if which == "bad":
        assert stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
    if "num_kv_blocks" in knobs:
        assert engine.scheduler.num_preemptions > 0


def _count_draft_reads(engine: LLMEngine) -> list[int]:
    """Tokens read by each draft forward from now on (the real forward runs)."""
    runner, reads = engine.speculator.proposer.runner, []
    real_run = runner.run

    def run(step):
        reads.append(sum(len(t) for t in step.token_ids))
        return real_run(step)

    runner.run = run
    return reads


def test_draft_reads_prompts_alongside_prefill_chunks_within_the_budget(tiny_llama):
    """In steps that speculate, the draft prefills the other requests' prompts with the target's
    chunks, never reading more than the step's token budget in one forward."""
    prompts, max_tokens = mixed_prompts(6, seed=11)
    plain = run_engine(LLMEngine(EngineConfig(model=str(tiny_llama))), prompts, max_tokens)
    engine = spec_engine(tiny_llama, tiny_llama, adaptive_speculation=False, max_num_batched_tokens=24)
    reads = _count_draft_reads(engine)
    assert run_engine(engine, prompts, max_tokens) == plain
    assert max(reads) <= 24
    stats = engine.stats()
    assert stats.spec_accepted_tokens_total == stats.spec_draft_tokens_total > 0  # the target drafts itself

    engine = spec_engine(tiny_llama, tiny_llama, adaptive_speculation=False, max_num_batched_tokens=24)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = engine.requests[engine.add_request([7, 8, 9], greedy)]
    while first.num_output_tokens < 2:  # decoding, speculating
        engine.step()
    second = engine.requests[engine.add_request(prompts[0] * 2, greedy)]
    while second.num_output_tokens == 0:  # its prompt in chunks, beside the first's verifications
        engine.step()
        assert first.spec.num_draft_tokens > 0
        assert second.spec.num_computed_tokens == min(second.num_computed_tokens, second.num_prompt_tokens - 1)
    assert second.num_prompt_tokens > 24  # it took several chunks


def test_a_draft_left_behind_catches_up_in_chunks_before_speculating(tiny_llama):
    """A prompt prefilled in steps that did not speculate (here: alone) leaves the draft behind;
    the draft then reads it a budget at a time and the request speculates only once the rest
    fits; the output is plain decoding's."""
    prompt = mixed_prompts(1, seed=5)[0][0] * 3
    plain = run_engine(LLMEngine(EngineConfig(model=str(tiny_llama))), [prompt], [20])
    engine = spec_engine(tiny_llama, tiny_llama, adaptive_speculation=False, max_num_batched_tokens=16)
    reads = _count_draft_reads(engine)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    request, tokens, catch_up_steps = engine.requests[rid], [], 0
    while engine.has_unfinished_requests():
        behind = request.num_tokens - request.spec.num_computed_tokens
        drafted = engine.stats().spec_draft_tokens_total
        outputs = engine.step()
        tokens += [t for out in outputs for t in out.token_ids]
        if request.num_output_tokens > 1 and behind > 16:  # decoding, further behind than the budget
            catch_up_steps += 1
            assert engine.stats().spec_draft_tokens_total == drafted  # no drafts until caught up ...
            assert request.num_tokens - request.spec.num_computed_tokens == behind + 1 - 16  # ... 16 at a time
    assert catch_up_steps >= 2 and max(reads) <= 16
    assert tokens == plain[0]
    assert engine.stats().spec_draft_tokens_total > 0


def test_abort_mid_speculation_frees_blocks(tiny_llama, bad_draft):
    engine = spec_engine(tiny_llama, bad_draft, block_size=4, adaptive_speculation=False)
    ids = [engine.add_request([5 + i] * (10 + i), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
           for i in range(4)]
    for _ in range(4):
        engine.step()
    for rid in ids[:2]:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_vocab_mismatch_is_a_startup_error(tiny_llama, tmp_path):
    other = write_tiny_model(tmp_path / "other_vocab", "llama", vocab_size=300)
    with pytest.raises(ValueError, match="draft_model: vocabulary size 300"):
        spec_engine(tiny_llama, other)


# -- lossless sampling: a distribution test with a sampler that must fail it when biased ----------

VOCAB = 6
_g = torch.Generator().manual_seed(0)
_BASE = torch.rand(VOCAB + 1, VOCAB, generator=_g) ** 3
P_TABLE = _BASE / _BASE.sum(-1, keepdim=True)  # toy target p(next | prev); prev = VOCAB at the start
Q_TABLE = torch.roll(P_TABLE, 1, dims=1) * 0.5 + 0.5 / VOCAB  # a poor but valid draft


def _verify(requests, drafts, qs, p, gen) -> list[list[int]]:
    """One step of the engine's sampler over target distributions p (as logits log p)."""
    sampler = Sampler()
    sampler.generator = gen
    meta = build_sampling_metadata(requests, drafts, VOCAB, gen, torch.device("cpu"))
    out = sampler(p.log(), meta, torch.cat(qs) if qs else None).token_ids.tolist()
    return [[t for t in row if t != PLACEHOLDER_TOKEN] for row in out]


def _lossless(trials, gen) -> list[list[int]]:
    """trials: (drafts, q [k, vocab], p [k + 1, vocab], request) each; verified in one step."""
    return _verify([t[3] for t in trials], [t[0] for t in trials], [t[1] for t in trials],
                   torch.cat([t[2] for t in trials]), gen)


def _lossless_among_others(trials, gen) -> list[list[int]]:
    """The same verification inside a batch: a greedy request before each and a sampled one with a
    one-hot (n-gram) proposal after it, their rows around its own."""
    one_hot = torch.nn.functional.one_hot(torch.tensor([0, 5, 1]), VOCAB).float()
    requests, drafts, qs, target = [], [], [], []
    for i, (d, q, p, req) in enumerate(trials):
        requests += [Request(f"g{i}", [0], SamplingParams(temperature=0.0)), req,
                     Request(f"o{i}", [0], SamplingParams(temperature=1.0, seed=99))]
        drafts += [[0], d, [5, 1]]
        qs += [one_hot[:1], q, one_hot[1:]]
        target += [P_TABLE[[VOCAB, 1]], p, P_TABLE[[2, 3, 4]]]
    tokens = _verify(requests, drafts, qs, torch.cat(target), gen)
    assert all(t[-1] == int(P_TABLE[VOCAB].argmax()) or len(t) == 2 for t in tokens[0::3])
    return tokens[1::3]


def _accept_all(trials, gen) -> list[list[int]]:
    return [list(t[0]) for t in trials]  # a wrong verifier: keeps every draft token


def _joint_first_two(rule, trials: int, seeded: bool, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram of the first two generated tokens over runs of one speculative step (k = 2
    draft tokens from q), seeded (seed t in run t: the keyed draws) or not (the engine's
    stream); when the step yields one token, the second is sampled from p as the next step
    would. Returns observed counts and the target's expected counts."""
    gen, draft_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    runs = []
    for t in range(trials):
        req = Request(f"r{t}", [0], SamplingParams(temperature=1.0, seed=t if seeded else None))
        d, qs, prev = [], [], VOCAB
        for _ in range(k):
            q = Q_TABLE[prev]
            d.append(int(torch.multinomial(q, 1, generator=draft_gen)))
            qs.append(q)
            prev = d[-1]
        runs.append((d, torch.stack(qs), torch.stack([P_TABLE[c] for c in [VOCAB] + d]), req))
    counts = torch.zeros(VOCAB * VOCAB)
    for tokens in rule(runs, gen):
        if len(tokens) == 1:
            tokens.append(int(torch.multinomial(P_TABLE[tokens[0]], 1, generator=draft_gen)))
        counts[tokens[0] * VOCAB + tokens[1]] += 1
    expected = (P_TABLE[VOCAB][:, None] * P_TABLE[:VOCAB]).flatten() * trials
    return counts, expected


def _chi_square_p(rule, seeded: bool, trials: int = 6000) -> float:
    counts, expected = _joint_first_two(rule, trials, seeded)
    keep = expected > 5
    obs, exp = counts[keep].double(), expected[keep].double()  # (chisquare checks the sums agree to 1.5e-8)
    return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


@pytest.mark.parametrize("seeded", [False, True])
def test_verification_is_lossless_and_a_biased_rule_fails(seeded):
    """Rejection sampling (unseeded) and keyed verification (seeded) both keep the target's joint
    distribution of the first two tokens, alone and among other requests."""
    assert _chi_square_p(_lossless, seeded) > 0.001
    assert _chi_square_p(_lossless_among_others, seeded) > 0.001
    assert _chi_square_p(_accept_all, seeded) < 1e-6


FILTERED = dict(temperature=0.7, top_p=0.9, top_k=6, min_p=0.05)  # on a less peaked target (below)
FILTERED_T1 = dict(temperature=1.0, top_p=0.9, top_k=5, min_p=0.05)


@pytest.mark.parametrize("method, async_scheduling, reduced, sampling", [
    ("draft", False, False, dict(seed=True)),
    ("draft", True, False, dict(seed=True)),
    ("draft", False, True, dict(seed=True)),
    ("draft", False, False, dict(seed=False)),
    ("draft", False, False, dict(seed=True, **FILTERED)),
    ("draft", True, False, dict(seed=False, **FILTERED)),
    ("ngram", False, False, dict(seed=True, **FILTERED_T1)),
    ("ngram", False, False, dict(seed=False)),
    ("suffix", False, False, dict(seed=True, **FILTERED_T1)),
    ("suffix", False, False, dict(seed=False)),
])
def test_engine_sampling_matches_target_distribution(tmp_path, method, async_scheduling, reduced, sampling):
    """End to end: with a poor draft, the 2nd and 3rd generated tokens (the ones speculation
    produces) follow the target's exact marginals, computed from HF by enumeration; with
    overlapped steps too (drafts proposed from tokens the host has not seen yet), with a draft
    whose vocabulary is 5 of the 8 tokens (q is 0 outside them), and with n-gram lookup (one-hot
    drafts); seeded (keyed draws) and not (rejection sampling), at T = 1 and filtered at T = 0.7."""
    vocab, trials, prompt = 8, 800, [3, 5, 4]
    # peaked, unlike a near-uniform random init; less so where the filters would leave one token,
    # and for the lookup, whose drafts this target then both keeps and rejects
    init = 0.4 if method in ("ngram", "suffix") else 0.3 if sampling.get("temperature") == 0.7 else 0.6
    sharp = dict(vocab_size=vocab, initializer_range=init)
    target = write_tiny_model(tmp_path / "t", "llama", seed=11, **sharp)
    if method in ("ngram", "suffix"):  # a prompt that repeats, so that the lookup proposes
        prompt = [7, 3, 7, 3, 7, 3]
        engine = spec_engine(target, method=method, adaptive_speculation=False, num_speculative_tokens=2)
        if method == "suffix":  # every draft, however unsure (this tiny target's drafts keep less than one token)
            engine.speculator.proposer.min_draft_score = 0.0
    else:
        draft = write_tiny_model(tmp_path / "d", "llama", seed=12, hidden_size=32, num_hidden_layers=1, **sharp)
        if reduced:
            draft = reduce_draft_vocabulary(draft, tmp_path / "reduced", [0, 2, 3, 5, 6], drop_embeddings=False)
        engine = spec_engine(target, draft, adaptive_speculation=False, num_speculative_tokens=2,
                             async_scheduling=async_scheduling)
    assert_speculation_follows_target(engine, target, prompt, vocab, trials, **sampling)


def exact_marginals(target: Path, prompt: list[int], vocab: int, **knobs) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's exact distributions of the 2nd and 3rd sampled tokens, by enumeration in HF,
    each next-token distribution filtered by the sampling knobs (temperature, top-k/p, min-p)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    request = Request("exact", [0], SamplingParams(**knobs))
    meta = build_sampling_metadata([request], [[]], vocab, torch.Generator(), torch.device("cpu"))

    def next_probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return probs_from_logits(hf(torch.tensor([ids])).logits[:, -1].float(), meta)[0]

    p1 = next_probs(prompt)
    p2, p3 = torch.zeros(vocab), torch.zeros(vocab)
    for a in range(vocab):
        pa = next_probs(prompt + [a])
        p2 += p1[a] * pa
        for b in range(vocab):
            p3 += p1[a] * pa[b] * next_probs(prompt + [a, b])
    return p2, p3


def assert_speculation_follows_target(engine: LLMEngine, target: Path, prompt: list[int], vocab: int,
                                     trials: int, seed: bool = True, **knobs) -> None:
    """`trials` requests of 3 tokens (seeded with seeds 0 .. trials - 1, or drawing from the
    engine's stream; T = 1 unless `knobs` say otherwise): drafts were both accepted and rejected,
    and the 2nd and 3rd tokens pass a chi-square test against the target's exact marginals."""
    knobs = {"temperature": 1.0, **knobs}
    for t in range(trials):
        engine.add_request(prompt, SamplingParams(max_tokens=3, seed=t if seed else None, ignore_eos=True, **knobs))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
    for position, expected in zip((1, 2), exact_marginals(target, prompt, vocab, **knobs)):
        counts = torch.bincount(torch.tensor([t[position] for t in tokens.values()]), minlength=vocab).float()
        keep = expected * trials > 5
        exp = expected[keep].double() * trials  # (in float64: chisquare checks the sums agree to 1.5e-8)
        obs = counts[keep].double()
        assert keep.sum() >= 3  # the test has something to test
        assert chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue > 0.001


def test_a_reduced_vocabulary_draft_drafts_its_tokens_only_and_stays_greedy_identical(tiny_llama, tmp_path):
    """The target as its own draft, its lm_head cut to the specials and every other byte, its
    embeddings dropped (it reads the target's, the same tensor): greedy output is the target's,
    every drafted token is one of the draft's, and those the target agrees with are accepted."""
    subset = [0, 1, 2] + list(range(3, 259, 2))
    draft = reduce_draft_vocabulary(tiny_llama, tmp_path / "reduced", subset, drop_embeddings=True)
    prompts, max_tokens = mixed_prompts(12, seed=5)
    plain = run_engine(LLMEngine(EngineConfig(model=str(tiny_llama))), prompts, max_tokens)
    engine = spec_engine(tiny_llama, draft, adaptive_speculation=False, num_speculative_tokens=3)
    assert engine.draft_model.model.embed_tokens.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    proposer, drafted = engine.speculator.proposer, []
    real_propose = proposer.propose

    def propose(*args, **kwargs):
        proposals = real_propose(*args, **kwargs)
        drafted.extend(t for p in proposals for t in p.device_token_ids.tolist())
        return proposals

    proposer.propose = propose
    assert run_engine(engine, prompts, max_tokens) == plain
    assert drafted and set(drafted) <= set(subset)
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total


@pytest.mark.parametrize("token_ids, dtype", [([3, 2], torch.int64), ([1, 1], torch.int64), ([5, 9999], torch.int64),
                                              ([1, 2], torch.int32)])
def test_a_bad_draft_vocabulary_is_a_startup_error(tiny_llama, tmp_path, token_ids, dtype):
    draft = reduce_draft_vocabulary(tiny_llama, tmp_path / "reduced", [1, 2], drop_embeddings=False)
    save_file({"token_ids": torch.tensor(token_ids, dtype=dtype)}, str(draft / DRAFT_VOCAB_FILE))
    with pytest.raises(ValidationError, match="draft_model: draft_vocab.safetensors"):
        spec_engine(tiny_llama, draft)

