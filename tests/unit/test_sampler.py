"""Sampler: exact filtering and penalties, seeded draws independent of batch-mates, drafts and k,
and following the row's distribution."""
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
        for _ in range(steps):
            rows = others[: batch_size // 2] + [seeded] + others[batch_size // 2 :]
            m = meta(*rows, vocab=50, generator=sampler.generator)
            tokens = sampler(logits.repeat(batch_size, 1), m).token_ids
            seeded.output_token_ids.append(int(tokens[batch_size // 2, 0]))
        return seeded.output_token_ids

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


def _seeded_requests(vocab: int) -> list[Request]:
    specs = [
        dict(temperature=0.8, top_k=20, seed=11),
        dict(temperature=1.0, top_p=0.9, repetition_penalty=1.3, seed=12),
        dict(temperature=0.7, min_p=0.05, min_tokens=5, stop_token_ids=[3, 4], seed=13),
        dict(temperature=0.9, seed=14, frequency_penalty=0.2),
        dict(temperature=1.1, top_k=30, seed=2**64 - 1),
        dict(temperature=0.0, seed=16),  # greedy: the seed does not matter
    ]
    return [Request(f"r{i}", [(5 * i + j) % vocab for j in range(3 + i)], SamplingParams(max_tokens=200, **kw),
                    eos_token_ids=frozenset({2})) for i, kw in enumerate(specs)]


def _toy_logits(context: list[int], vocab: int) -> torch.Tensor:
    """A deterministic toy model: the next token's logits [vocab] from the last three tokens."""
    key = sum(t * 131 ** i for i, t in enumerate(context[-3:])) + len(context)
    return torch.randn(vocab, generator=torch.Generator().manual_seed(key)).mul(2.5)


def _generate_seeded(vocab: int, steps: int, ks: list[int], draft_rng: torch.Generator | None,
                     others: int) -> tuple[dict[str, list[int]], int]:
    """Generate with the toy model, each step verifying ks[step % len(ks)] drafts per request
    (each the toy model's argmax or a random token, with a draft distribution or one-hot), the
    seeded requests placed among `others` unseeded ones. Returns the seeded requests' tokens and
    the number of drafts accepted."""
    requests = _seeded_requests(vocab)
    rows = [Request(f"o{i}", [i], SamplingParams(temperature=1.0, max_tokens=200)) for i in range(others)]
    batch = rows[: others // 2] + requests + rows[others // 2 :]
    sampler, accepted = Sampler(seed=others), 0
    for step in range(steps):
        k = ks[step % len(ks)]
        drafts, logits, qs = [], [], []
        for r in batch:
            context, d = r.all_token_ids, []
            for i in range(k + 1):
                logits.append(_toy_logits(context + d, vocab))
                if i < k:
                    guess = int(logits[-1].argmax()) if torch.rand(1, generator=draft_rng) < 0.6 else \
                        int(torch.randint(vocab, (1,), generator=draft_rng))
                    d.append(guess)
                    qs.append(torch.randn(vocab, generator=draft_rng).softmax(-1) if step % 2 else
                              torch.nn.functional.one_hot(torch.tensor(guess), vocab).float())
            drafts.append(d)
        m = build_sampling_metadata(batch, drafts, vocab, sampler.generator, torch.device("cpu"))
        out = sampler(torch.stack(logits), m, torch.stack(qs) if qs else None).token_ids.tolist()
        for r, d, tokens in zip(batch, drafts, out):
            tokens = [t for t in tokens if t != PLACEHOLDER_TOKEN]
            r.output_token_ids += tokens
            accepted += (len(tokens) - 1) * r.request_id.startswith("r")
    return {r.request_id: r.output_token_ids[:steps] for r in requests}, accepted


def test_seeded_tokens_do_not_depend_on_drafts_k_or_batch_mates():
    """Seeded requests (filters, penalties, min_tokens, the largest seed, a greedy one) give the
    same tokens without speculation, alone, and verifying 1-4 random or right drafts per step
    (with a draft distribution or one-hot) among 0-9 unseeded batch-mates."""
    vocab, steps = 64, 30
    plain, _ = _generate_seeded(vocab, steps, [0], None, others=0)
    for ks, others in (([2], 3), ([1, 4, 0, 3], 0), ([4], 9)):
        tokens, accepted = _generate_seeded(vocab, steps, ks, torch.Generator().manual_seed(len(ks)), others)
        assert tokens == plain
        assert accepted > 10  # drafts were kept, and others rejected (the tokens would differ otherwise)
    assert len(set(plain["r0"])) > 5 and plain["r0"] != plain["r1"]  # it does sample


def test_seeded_sampling_follows_the_filtered_distribution():
    """Over 4,000 seeds at one output index, and over 4,000 output indices of one seed, a seeded
    row's token passes a chi-square test against the row's distribution after temperature,
    top-p and min-p; a token the filters remove is never drawn."""
    from scipy.stats import chisquare

    logits = torch.log(torch.tensor([0.30, 0.22, 0.18, 0.12, 0.08, 0.05, 0.03, 0.02]))
    kw = dict(temperature=0.7, top_p=0.95, min_p=0.02)
    expected = probs_from_logits(logits[None].clone(), meta(request(**kw), vocab=8))[0]
    assert (expected == 0).sum() >= 1
    for vary in ("seed", "position"):
        rows = [request(output=[0] * (i if vary == "position" else 0), seed=i if vary == "seed" else 7, **kw)
                for i in range(4000)]
        tokens = Sampler()(logits.repeat(4000, 1), meta(*rows, vocab=8)).token_ids[:, 0]
        counts = torch.bincount(tokens, minlength=8)
        assert counts[expected == 0].sum() == 0
        keep = expected > 0
        exp = expected[keep].double()
        assert chisquare(counts[keep].double().numpy(), (exp / exp.sum() * 4000).numpy()).pvalue > 1e-3
