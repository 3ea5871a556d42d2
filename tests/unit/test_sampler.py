"""Sampler: exact filtering and penalties, seeded draws independent of batch-mates."""
import torch

from backend.request import Request
from backend.sampler import Sampler, SamplingRow, apply_penalties, probs_from_logits
from backend.sampling_params import SamplingParams


def row(prompt=(0,), output=(), eos=frozenset(), **kw) -> SamplingRow:
    r = Request("r", list(prompt), SamplingParams(**kw), eos_token_ids=eos)
    r.output_token_ids = list(output)
    return SamplingRow(r)


LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))


def test_top_k_top_p_min_p_exact():
    p = probs_from_logits(LOGITS.clone(), [row(top_k=2)])
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    p = probs_from_logits(LOGITS.clone(), [row(top_p=0.7)])  # 0.5 + 0.25 reaches 0.7
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    p = probs_from_logits(LOGITS.clone(), [row(top_p=0.5)])  # the top token alone has 0.5
    assert torch.allclose(p, torch.tensor([[1.0, 0, 0, 0]]))
    p = probs_from_logits(LOGITS.clone(), [row(min_p=0.3)])  # keep p >= 0.15
    assert torch.allclose(p, torch.tensor([[0.5, 0.25, 0.15, 0]]) / 0.9)
    p = probs_from_logits(LOGITS.clone(), [row(temperature=0.0)])
    assert p.tolist() == [[1.0, 0, 0, 0]]


def test_temperature():
    p = probs_from_logits(LOGITS.clone(), [row(temperature=0.5)])
    q = torch.tensor([0.5, 0.25, 0.15, 0.1]) ** 2
    assert torch.allclose(p[0], q / q.sum())


def test_penalties():
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5]])
    out = apply_penalties(logits.clone(), [row(prompt=[0], output=[1, 2, 2], repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -2.0, 0.5, 0.5]]
    out = apply_penalties(logits.clone(), [row(output=[2, 2], frequency_penalty=0.5, presence_penalty=0.25)])
    assert out.tolist() == [[2.0, -1.0, 1.0 - 1.0 - 0.25, 0.5]]


def test_min_tokens_masks_eos_and_stop_ids():
    out = apply_penalties(LOGITS.clone(), [row(output=[1], eos=frozenset({0}), min_tokens=2, stop_token_ids=[3])])
    assert out[0, 0] == float("-inf") and out[0, 3] == float("-inf") and out[0, 1] > float("-inf")
    out = apply_penalties(LOGITS.clone(), [row(output=[1, 1], eos=frozenset({0}), min_tokens=2)])
    assert out[0, 0] > float("-inf")


def test_seeded_rows_do_not_depend_on_batch_mates():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)

    def draw(batch_size: int, steps: int = 20) -> list[int]:
        seeded = row(seed=1234)
        others = [row(temperature=1.0) for _ in range(batch_size - 1)]
        sampler = Sampler(seed=batch_size)
        out = []
        for _ in range(steps):
            rows = others[: batch_size // 2] + [seeded] + others[batch_size // 2 :]
            tokens, _ = sampler(logits.repeat(batch_size, 1), rows)
            out.append(tokens[batch_size // 2])
        return out

    alone = draw(1)
    assert draw(5) == alone and draw(9) == alone
    assert len(set(alone)) > 3  # it does sample


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler(seed=0)
    rows = [row(temperature=1.0) for _ in range(4000)]
    tokens, _ = sampler(probs.log().repeat(4000, 1), rows)
    freq = torch.bincount(torch.tensor(tokens), minlength=3) / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_inverse_cdf_draws_exactly_and_never_a_zero_probability_token():
    """Unnormalised rows with zeros at both ends and inside; frequencies pass a chi-square test."""
    from scipy.stats import chisquare

    from backend.sampler import inverse_cdf

    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 5.0, 0.0, 0.5, 1.5, 0.0])
    n = 20000
    tokens = inverse_cdf(weights.repeat(n, 1), [row(temperature=1.0) for _ in range(n)],
                         torch.Generator().manual_seed(7))
    counts = torch.bincount(tokens, minlength=len(weights))
    assert counts[weights == 0].sum() == 0
    nonzero = weights > 0
    expected = (weights[nonzero] / weights.sum() * n).numpy()
    assert chisquare(counts[nonzero].numpy(), expected).pvalue > 1e-3


def test_logprobs_chosen_and_top():
    _, lps = Sampler()(LOGITS.clone(), [row(temperature=0.0, logprobs=2)])
    assert lps[0]["token_id"] == 0
    assert abs(lps[0]["logprob"] - torch.log(torch.tensor(0.5)).item()) < 1e-6
    assert list(lps[0]["top"]) == [0, 1]
