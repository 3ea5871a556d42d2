"""Speculative-decoding verification by rejection sampling (Leviathan et al. 2023, arXiv 2211.17192).

For one request the draft proposed tokens d_1..d_k, drawn from its distributions q_1..q_k; the
target scored the same positions, giving p_1..p_{k+1} (every sampling parameter applied to both).
Walking i = 1..k:
  accepted:  d_i is kept with probability min(1, p_i(d_i) / q_i(d_i));
  recovered: at the first rejection the walk stops and one token is drawn from
             norm(max(0, p_i - q_i)), which makes the kept token distributed exactly as p_i;
  bonus:     when all k pass, one more token is drawn from p_{k+1} for free.
So every step yields between 1 and k+1 tokens and the output follows the target's distribution
exactly. Greedy requests have one-hot p and q: d_i is kept iff it is the target's argmax, and the
recovered or bonus token is the target's argmax; no random draw is made for them.
A proposer without a distribution (n-gram lookup) is a one-hot q on its token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.sampler import SamplingRow, inverse_cdf, uniform_noise


@dataclass(slots=True)
class Verdict:
    num_accepted: int  # draft tokens kept
    tokens: list[int]  # the kept draft tokens then the recovered or bonus token


def verify(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,  # [k, vocab] q_i; None for a one-hot proposer
    target_probs: torch.Tensor,  # [k + 1, vocab] p_i
    rows: list[SamplingRow],  # k + 1 rows of this request (for its generator)
    generator: torch.Generator,
) -> Verdict:
    k = len(draft_tokens)
    greedy = rows[0].request.params.greedy
    if greedy:
        target_argmax = target_probs.argmax(-1).tolist()
        n = 0
        while n < k and draft_tokens[n] == target_argmax[n]:
            n += 1
        return Verdict(n, draft_tokens[:n] + [target_argmax[n]])

    idx = torch.arange(k, device=target_probs.device)
    d = torch.tensor(draft_tokens, dtype=torch.long, device=target_probs.device)
    p_d = target_probs[idx, d]
    q_d = draft_probs[idx, d] if draft_probs is not None else torch.ones(k, device=p_d.device)
    u = uniform_noise(rows[:k], p_d.device, generator)
    # accept d_i when u_i < p_i(d_i) / q_i(d_i), i.e. u_i * q_i(d_i) < p_i(d_i)
    rejected = (u * q_d >= p_d).tolist()
    n = rejected.index(True) if True in rejected else k
    if n < k:
        q = draft_probs[n] if draft_probs is not None else torch.zeros_like(target_probs[n]).index_fill_(0, d[n : n + 1], 1.0)
        residual = (target_probs[n] - q).clamp_min(0)
        total = residual.sum()
        # total == 0 only when p == q, where rejection has probability 0; fall back to p
        dist = residual / total if total > 0 else target_probs[n]
    else:
        dist = target_probs[k]
    last = int(inverse_cdf(dist[None, :], rows[n : n + 1], generator)[0])
    return Verdict(n, draft_tokens[:n] + [last])
