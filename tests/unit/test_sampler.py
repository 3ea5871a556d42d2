"""Sampler: exact filtering and penalties, seeded draws independent of batch-mates, and the same
seeded draws as the per-row host sampler it replaced."""
import json
from pathlib import Path

import torch

from backend.core.request import Request
from backend.sample.sampler import PLACEHOLDER_TOKEN, Sampler, apply_penalties, inverse_cdf, probs_from_logits
from backend.sample.sampling_metadata import build_sampling_metadata
from backend.sampling_params import SamplingParams

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))


def request(prompt=(0,), output=(), eos=frozenset(), **kw) -> Request:
    r = Request("r", list(prompt), SamplingParams(**kw), eos_token_ids=eos)
    r.output_token_ids = list(output)
    return r


def meta(*requests: Request, drafts=None, vocab=4, generator=None):
    drafts = drafts or [[] for _ in requests]
    return build_sampling_metadata(list(requests), drafts, vocab, generator or torch.Generator(), torch.device("cpu"))


def test_top_k_top_p_min_p_exact():
    p = probs_from_logits(LOGITS.clone(), meta(request(top_k=2)))
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    p = probs_from_logits(LOGITS.clone(), meta(request(top_p=0.7)))  # 0.5 + 0.25 reaches 0.7
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    p = probs_from_logits(LOGITS.clone(), meta(request(top_p=0.5)))  # the top token alone has 0.5
    assert torch.allclose(p, torch.tensor([[1.0, 0, 0, 0]]))
    p = probs_from_logits(LOGITS.clone(), meta(request(min_p=0.3)))  # keep p >= 0.15
    assert torch.allclose(p, torch.tensor([[0.5, 0.25, 0.15, 0]]) / 0.9)


def test_temperature():
    p = probs_from_logits(LOGITS.clone(), meta(request(temperature=0.5)))
    q = torch.tensor([0.5, 0.25, 0.15, 0.1]) ** 2
    assert torch.allclose(p[0], q / q.sum())


def test_penalties():
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5]])
    out = apply_penalties(logits.clone(), meta(request(prompt=[0], output=[1, 2, 2], repetition_penalty=2.0)))
    assert out.tolist() == [[1.0, -2.0, 0.5, 0.5]]
    out = apply_penalties(logits.clone(), meta(request(output=[2, 2], frequency_penalty=0.5, presence_penalty=0.25)))
    assert out.tolist() == [[2.0, -1.0, 1.0 - 1.0 - 0.25, 0.5]]


def test_penalties_see_the_draft_tokens_before_each_row():
    """Row i of a verification counts draft tokens 0..i-1 as output."""
    logits = torch.zeros(3, 4)
    m = meta(request(output=[1], frequency_penalty=1.0), drafts=[[2, 3]])
    out = apply_penalties(logits, m)
    assert out.tolist() == [[0, -1, 0, 0], [0, -1, -1, 0], [0, -1, -1, -1]]


def test_min_tokens_masks_eos_and_stop_ids():
    out = apply_penalties(LOGITS.clone(), meta(request(output=[1], eos=frozenset({0}), min_tokens=2, stop_token_ids=[3])))
    assert out[0, 0] == float("-inf") and out[0, 3] == float("-inf") and out[0, 1] > float("-inf")
    out = apply_penalties(LOGITS.clone(), meta(request(output=[1, 1], eos=frozenset({0}), min_tokens=2)))
    assert out[0, 0] > float("-inf")


def test_a_request_whose_rows_cannot_be_built_is_reported_alone():
    bad = request(min_tokens=3, stop_token_ids=[100])
    good = request(temperature=0.0)
    m = meta(bad, good)
    assert list(m.errors) == ["r"] and m.errors["r"].__class__ is IndexError
    assert m.banned_rows is None  # the bad request's rows are neutral


def test_seeded_rows_do_not_depend_on_batch_mates():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)

    def draw(batch_size: int, steps: int = 20) -> list[int]:
        seeded = request(seed=1234)
        others = [request(temperature=1.0) for _ in range(batch_size - 1)]
        sampler = Sampler(seed=batch_size)
        out = []
        for _ in range(steps):
            rows = others[: batch_size // 2] + [seeded] + others[batch_size // 2 :]
            m = meta(*rows, vocab=50, generator=sampler.generator)
            tokens = sampler(logits.repeat(batch_size, 1), m).token_ids
            out.append(int(tokens[batch_size // 2, 0]))
        return out

    alone = draw(1)
    assert draw(5) == alone and draw(9) == alone
    assert len(set(alone)) > 3  # it does sample


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler(seed=0)
    rows = [request(temperature=1.0) for _ in range(4000)]
    tokens = sampler(probs.log().repeat(4000, 1), meta(*rows, vocab=3, generator=sampler.generator)).token_ids
    freq = torch.bincount(tokens[:, 0], minlength=3) / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_inverse_cdf_draws_exactly_and_never_a_zero_probability_token():
    """Unnormalised rows with zeros at both ends and inside; frequencies pass a chi-square test."""
    from scipy.stats import chisquare

    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 5.0, 0.0, 0.5, 1.5, 0.0])
    n = 20000
    tokens = inverse_cdf(weights.repeat(n, 1), torch.rand(n, generator=torch.Generator().manual_seed(7)))
    counts = torch.bincount(tokens, minlength=len(weights))
    assert counts[weights == 0].sum() == 0
    nonzero = weights > 0
    expected = (weights[nonzero].double() / weights.sum().double() * n).numpy()
    assert chisquare(counts[nonzero].numpy(), expected).pvalue > 1e-3


def test_logprobs_chosen_and_top():
    out = Sampler()(LOGITS.clone(), meta(request(temperature=0.0, logprobs=2)))
    assert out.token_ids.tolist() == [[0]]
    (chosen, rank, top_ids, top_values), = out.logprobs.entries().values()
    assert abs(chosen - torch.log(torch.tensor(0.5)).item()) < 1e-6
    assert rank == 1  # greedy: the most likely token
    assert top_ids[:2] == [0, 1]


def test_the_rank_of_a_sampled_token_counts_the_tokens_more_likely():
    seen = set()
    for seed in range(40):
        out = Sampler()(LOGITS.clone(), meta(request(temperature=1.0, seed=seed, logprobs=0)))
        token = out.token_ids.tolist()[0][0]
        (chosen, rank, _, _), = out.logprobs.entries().values()
        logp = torch.log_softmax(LOGITS[0], -1)
        assert rank == 1 + int((logp > logp[token]).sum())
        seen.add(rank)
    assert len(seen) > 1


def test_greedy_verification_keeps_the_argmax_prefix_then_the_argmax():
    x = torch.full((4, 5), -5.0)
    for row, top in enumerate([3, 1, 4, 2]):
        x[row, top] = 5.0
    out = Sampler()(x, meta(request(temperature=0.0), drafts=[[3, 1, 0]], vocab=5))
    assert out.token_ids.tolist() == [[3, 1, 4, PLACEHOLDER_TOKEN]]  # d_3 = 0 rejected, argmax 4
    out = Sampler()(x.clone(), meta(request(temperature=0.0), drafts=[[3, 1, 4]], vocab=5))
    assert out.token_ids.tolist() == [[3, 1, 4, 2]]  # all accepted, then the bonus token


def _golden_requests(vocab: int) -> list[Request]:
    specs = [
        dict(temperature=0.8, top_k=20, seed=11),
        dict(temperature=1.0, top_p=0.9, repetition_penalty=1.3, seed=12),
        dict(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=0.7, min_p=0.05, min_tokens=5, stop_token_ids=[3, 4], seed=13),
        dict(temperature=0.9, seed=14, frequency_penalty=0.2),  # drafts with a distribution (draft model)
        dict(temperature=1.1, top_k=30, seed=15),  # one-hot drafts (n-gram)
        dict(temperature=1.0),  # unseeded
        dict(temperature=0.0, seed=16),  # greedy, with drafts
    ]
    return [Request(f"r{i}", [(5 * i + j) % vocab for j in range(3 + i)], SamplingParams(max_tokens=200, **kw),
                    eos_token_ids=frozenset({2})) for i, kw in enumerate(specs)]


def _golden_step(step: int, requests: list[Request], rng: torch.Generator, vocab: int):
    """Per request: its draft tokens this step, their distributions (None: one-hot), its logits
    [k + 1, vocab]. Every other draft token is the target's top logit, so that some are accepted."""
    drafts, qs, logits = [], [], []
    for i, _ in enumerate(requests):
        k = {4: 3, 5: 2, 7: 3}.get(i, 0) if step % 3 else 0
        x = torch.randn(k + 1, vocab, generator=rng).mul(2.5)
        d = torch.randint(0, vocab, (k,), generator=rng).tolist()
        drafts.append([int(x[j].argmax()) if (j + step) % 2 == 0 else d[j] for j in range(k)])
        qs.append(torch.randn(k, vocab, generator=rng).mul(2).softmax(-1) if i == 4 and k else None)
        logits.append(x)
    return drafts, qs, torch.cat(logits)


def test_seeded_draws_equal_the_per_row_host_sampler():
    """24 steps of 8 requests (filters, penalties, min_tokens, drafts verified with and without a
    draft distribution, greedy): every seeded request's tokens equal what the per-row host
    sampler and rejection sampler this one replaced produced on the same logits
    (data/sampler_seeded_draws.json). Unseeded requests draw from the engine's generator, whose
    order of draws changed."""
    vocab = 64
    expected = json.loads((Path(__file__).parent / "data" / "sampler_seeded_draws.json").read_text())
    requests = _golden_requests(vocab)
    rng, sampler = torch.Generator().manual_seed(99), Sampler(seed=0)
    got = {r.request_id: [] for r in requests}
    for step in range(24):
        drafts, qs, logits = _golden_step(step, requests, rng, vocab)
        m = build_sampling_metadata(requests, drafts, vocab, sampler.generator, torch.device("cpu"))
        q_rows = [q if q is not None else torch.zeros(len(d), vocab) for d, q in zip(drafts, qs)]
        # the one-hot (n-gram) request's q as a one-hot: the two forms must agree
        for b, (d, q) in enumerate(zip(drafts, qs)):
            if q is None and d:
                q_rows[b] = torch.nn.functional.one_hot(torch.tensor(d), vocab).float()
        out = sampler(logits, m, torch.cat(q_rows)).token_ids.tolist()
        for r, tokens in zip(requests, out):
            tokens = [t for t in tokens if t != PLACEHOLDER_TOKEN]
            r.output_token_ids += tokens
            got[r.request_id].append(tokens)
    assert {rid: got[rid] for rid in expected} == expected
    assert sum(map(len, expected["r4"])) > 40  # verification accepted draft tokens
