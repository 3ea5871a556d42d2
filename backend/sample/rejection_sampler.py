"""Speculative-decoding verification by rejection sampling (Leviathan et al. 2023, arXiv 2211.17192),
for a whole step at once, on the device.

For one request the draft proposed tokens d_1..d_k, drawn from its distributions q_1..q_k; the
target scored the same positions, giving p_1..p_{k+1} (every sampling parameter applied to both).
Walking i = 1..k:
  accepted:  d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)), i.e. when u_i q_i(d_i) < p_i(d_i);
  recovered: at the first rejection the walk stops and one token is drawn from
             norm(max(0, p_i - q_i)), which makes the kept token distributed exactly as p_i;
  bonus:     when all k pass, one more token is drawn from p_{k+1} for free.
So every step yields between 1 and k+1 tokens and the output follows the target's distribution
exactly. A request without drafts (k = 0) is the bonus case: one token drawn from p_1.
A proposer without a distribution (n-gram lookup) is a one-hot q on its token.

Requests whose tokens are decided row by row skip all of that: they keep d_i iff it equals row i's
token and then take the token of the row where they stopped. A greedy row's token is its argmax;
a seeded row's is its sample keyed on (seed, output index) (seeded_noise.py), distributed as p_i
whatever was drafted, so those requests' output is the target's too, and the same for any k.
"""
from __future__ import annotations

import torch

from backend.sample.sampling_metadata import SamplingMetadata

PLACEHOLDER_TOKEN = -1  # output columns past a request's last token


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from its distribution (rows need not sum to 1): the token whose
    cumulative-probability interval holds u * total. A zero-probability token has an empty
    interval and is never drawn. probs: [N, vocab]; uniform: [N] in [0, 1); returns [N] int64."""
    cdf = probs.double().cumsum(-1)
    x = uniform.double() * cdf[:, -1]
    return torch.searchsorted(cdf, x[:, None], right=True).squeeze(1).clamp_max(probs.shape[1] - 1)


def rejection_sample(
    decided_tokens: torch.Tensor | None,  # [R] int64: the rows' decided tokens (argmax, keyed sample); None: none
    probs: torch.Tensor | None,  # [R, vocab] p of each row; None when no request draws from the stream
    draft_probs: torch.Tensor | None,  # [D, vocab] q of each draft token; None: one-hot on it
    meta: SamplingMetadata,
) -> torch.Tensor:  # [B, max_k + 1] int64, PLACEHOLDER_TOKEN past each request's last token
    num_requests, max_k = len(meta.requests), meta.max_k
    drafts = meta.draft_token_ids  # [D]
    device = drafts.device
    if max_k == 0:  # no drafts: one row per request, each the bonus case
        if probs is None:
            return decided_tokens[:, None]
        sampled = inverse_cdf(probs, meta.uniform_last)
        return (sampled if decided_tokens is None else torch.where(meta.decided, decided_tokens, sampled))[:, None]
    num_accepted = torch.zeros(num_requests, dtype=torch.int64, device=device)
    if drafts.numel():
        target_rows = meta.first_row[meta.draft_request] + meta.draft_position  # [D]
        accepted = drafts == decided_tokens[target_rows] if decided_tokens is not None else None
        if probs is not None:
            p_d = probs[target_rows, drafts]
            q_d = draft_probs.gather(1, drafts[:, None])[:, 0] if draft_probs is not None else torch.ones_like(p_d)
            by_ratio = meta.uniform_drafts * q_d < p_d
            accepted = by_ratio if accepted is None else torch.where(meta.decided[meta.draft_request], accepted, by_ratio)
        rejected = torch.zeros(num_requests, max_k, dtype=torch.bool, device=device)
        rejected[meta.draft_request, meta.draft_position] = ~accepted
        # the walk stops at the first rejection, or after all k_b
        num_accepted = torch.where(rejected.any(1), rejected.int().argmax(1), meta.num_drafts_t)
    last_rows = meta.first_row + num_accepted  # [B] the row the last token comes from
    last = decided_tokens[last_rows] if decided_tokens is not None else None
    if probs is not None:
        p_last = probs[last_rows]  # [B, vocab]
        dist = p_last
        if drafts.numel():
            stopped = num_accepted < meta.num_drafts_t  # rejected: draw from the residual
            at = (meta.draft_offset + num_accepted).clamp_max(drafts.numel() - 1)
            if draft_probs is not None:
                q = draft_probs[at]
            else:
                q = torch.zeros_like(p_last).scatter_(1, drafts[at][:, None], 1.0)
            residual = (p_last - q * stopped[:, None]).clamp_min(0)
            total = residual.sum(-1, keepdim=True)
            # the residual sums to 0 only when p == q, where rejection has probability 0: keep p
            dist = torch.where(total > 0, residual / total.clamp_min(1e-30), p_last)
        sampled = inverse_cdf(dist, meta.uniform_last)
        last = sampled if last is None else torch.where(meta.decided, last, sampled)
    token_ids = torch.full((num_requests, max_k + 1), PLACEHOLDER_TOKEN, dtype=torch.int64, device=device)
    if drafts.numel():
        token_ids[meta.draft_request, meta.draft_position] = drafts
        columns = torch.arange(max_k + 1, device=device)[None, :]
        token_ids.masked_fill_(columns >= num_accepted[:, None], PLACEHOLDER_TOKEN)
    return token_ids.scatter_(1, num_accepted[:, None], last[:, None])
