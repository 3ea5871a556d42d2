"""Turn logits into tokens: penalties, temperature, top-k, top-p, min-p, seeded sampling, logprobs.

Each row of the logits belongs to one request (and, when verifying draft tokens, one position:
`extra_output` holds the draft tokens before it, counted as output for penalties and min_tokens).
Random draws come from the request's own generator when it has a seed, so its tokens do not
depend on its batch-mates. Sampling is exact: inverse-CDF sampling, one uniform draw per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.errors import is_fatal
from backend.request import Request


def on_device(values, device, dtype=None) -> torch.Tensor:
    """A host list as a tensor on `device`, uploaded without waiting for queued device work (a
    plain upload would wait for the forward in flight when steps overlap)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


@dataclass(slots=True)
class SamplingRow:
    request: Request
    extra_output: list[int] = field(default_factory=list)  # draft tokens before this position
    error: Exception | None = None  # this row's penalties raised: its request fails alone

    @property
    def num_output(self) -> int:
        return self.request.num_output_tokens + len(self.extra_output)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties, and the
    EOS/stop-token mask before min_tokens. logits: [num_rows, vocab] float32, changed in place.
    A row whose penalties raise keeps the exception in `row.error` (its request is failed by the
    engine) and the other rows go on; a fatal (device) error is raised."""
    for i, row in enumerate(rows):
        try:
            _penalize_row(logits, i, row)
        except Exception as e:
            if is_fatal(e):
                raise
            row.error = e
    return logits


def _penalize_row(logits: torch.Tensor, i: int, row: SamplingRow) -> None:
    vocab = logits.shape[1]
    p = row.request.params
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        output = row.request.output_token_ids + row.extra_output
        out_ids = on_device(output, logits.device, torch.long)
        counts = torch.zeros(vocab, device=logits.device).index_add_(
            0, out_ids, torch.ones(len(output), device=logits.device)
        )
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[on_device(row.request.prompt_token_ids, logits.device, torch.long)] = True
            x = logits[i]
            penalized = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            logits[i] = torch.where(seen, penalized, x)
        if p.frequency_penalty:
            logits[i] -= p.frequency_penalty * counts
        if p.presence_penalty:
            logits[i] -= p.presence_penalty * (counts > 0).float()
    if row.num_output < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(row.request.eos_token_ids))
        if banned:
            logits[i, on_device(banned, logits.device, torch.long)] = float("-inf")


def probs_from_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each row samples from: [num_rows, vocab] float32. Greedy rows
    (temperature 0) get a one-hot on their argmax."""
    n, vocab = logits.shape
    device = logits.device
    params = [r.request.params for r in rows]
    temperature = on_device([p.temperature if not p.greedy else 1.0 for p in params], device)
    x = logits / temperature[:, None]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(t < 1.0 for t in top_p):
        sorted_x, order = x.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        drop = rank >= on_device(top_k, device)[:, None]
        sorted_probs = sorted_x.masked_fill(drop, float("-inf")).softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop |= mass_before >= on_device(top_p, device)[:, None]  # keeps the top token
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    if any(p.min_p > 0 for p in params):
        min_p = on_device([p.min_p for p in params], device)
        keep = probs >= min_p[:, None] * probs.max(-1, keepdim=True).values
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    if any(p.greedy for p in params):
        greedy = on_device([p.greedy for p in params], device)
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def uniform_noise(rows: list[SamplingRow], device, generator) -> torch.Tensor:
    """One U(0, 1) draw per row, from the request's generator when it has a seed."""
    u = torch.rand(len(rows), generator=generator)
    for i, row in enumerate(rows):
        if row.request.generator is not None:
            u[i] = torch.rand(1, generator=row.request.generator)[0]
    return u.to(device, non_blocking=True)


def inverse_cdf(probs: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator) -> torch.Tensor:
    """One token per row drawn from its distribution (rows need not sum to 1): the token whose
    cumulative-probability interval holds u * total. One uniform per row, whatever the vocabulary;
    a zero-probability token has an empty interval and is never drawn. [num_rows] int64."""
    cdf = probs.double().cumsum(-1)
    x = uniform_noise(rows, probs.device, generator).double() * cdf[:, -1]
    return torch.searchsorted(cdf, x[:, None], right=True).squeeze(1).clamp_max(probs.shape[1] - 1)


def sample_from_probs(probs: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator) -> torch.Tensor:
    """One token per row: [num_rows] int64. Greedy rows take their argmax without any draw."""
    greedy = [r.request.params.greedy for r in rows]
    tokens = probs.argmax(-1)
    if all(greedy):
        return tokens
    sampled_rows = [r for r, g in zip(rows, greedy) if not g]
    idx = on_device([i for i, g in enumerate(greedy) if not g], probs.device, torch.long)
    tokens[idx] = inverse_cdf(probs[idx], sampled_rows, generator)
    return tokens


@dataclass(slots=True)
class Logprobs:
    """Log-probabilities of the rows that asked for them, gathered where the logits are: `rows`
    (indices), the chosen token's [len(rows)] and the top-n values and ids [len(rows), max n]."""
    rows: list[int]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def entries(self, tokens: list[int], rows: list[SamplingRow]) -> list[dict | None]:
        """One entry per row (None where not asked): the chosen token's and the top-n logprobs."""
        out: list[dict | None] = [None] * len(rows)
        chosen, values, ids = self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        for j, i in enumerate(self.rows):
            n = rows[i].request.params.logprobs
            out[i] = {"token_id": tokens[i], "logprob": chosen[j], "top": dict(zip(ids[j][:n], values[j][:n]))}
        return out


def wants_logprobs(rows: list[SamplingRow]) -> bool:
    return any(r.request.params.logprobs is not None for r in rows)


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> Logprobs | None:
    """Log-probabilities of the model's raw distribution for the rows that want them, computed on
    the logits' device without reading anything back; None when no row wants them."""
    wanted = [i for i, r in enumerate(rows) if r.request.params.logprobs is not None]
    if not wanted:
        return None
    index = on_device(wanted, logits.device, torch.long)
    logp = torch.log_softmax(logits.index_select(0, index), dim=-1)
    chosen = logp.gather(1, tokens.to(logits.device).index_select(0, index)[:, None])[:, 0]
    top = logp.topk(max(max(rows[i].request.params.logprobs for i in wanted), 1), dim=-1)
    return Logprobs(wanted, chosen, top.values, top.indices)


def compute_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]
) -> list[dict | None]:
    """Log-probabilities of the model's raw distribution: the chosen token and the top-n."""
    found = gather_logprobs(logits, tokens, rows)
    if found is None:
        return [None] * len(rows)
    return found.entries(tokens.tolist(), rows)


class Sampler:
    """Turns a step's logits into tokens. Holds the engine's generator, which requests without a
    seed draw from. The engine (target rows and verification), the draft proposer and tests all go
    through `distributions` then `sample`."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    @staticmethod
    def distributions(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Penalties applied (in place), then each row's distribution; when every row is greedy,
        the penalised logits themselves (an argmax needs no distribution)."""
        logits = apply_penalties(logits, rows)
        if all(row.request.params.greedy for row in rows):
            return logits
        return probs_from_logits(logits, rows)

    def sample(self, distributions: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token per row of `distributions` (from `distributions`): [num_rows] int64."""
        return sample_from_probs(distributions, rows, self.generator)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[dict | None]]:
        """logits: [num_rows, vocab] float32 from the model, left unchanged."""
        tokens = self.sample(self.distributions(logits.clone(), rows), rows)
        return tokens.tolist(), compute_logprobs(logits, tokens, rows)
