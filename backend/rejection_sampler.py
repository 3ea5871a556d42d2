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


@dataclass(slots=True)
class Proposal:
    """One request's drafts for verification."""
    draft_tokens: list[int]  # d_1..d_k
    draft_probs: torch.Tensor | None  # [k, vocab] q_i; None for a one-hot proposer or a greedy request
    first_row: int  # its first row in the step's target distributions (k + 1 rows from there)


def verify_batch(
    proposals: list[Proposal],
    target_probs: torch.Tensor,  # [num_rows, vocab] p_i for every row of the step
    rows: list[SamplingRow],  # one per row of target_probs (each request's generator)
    generator: torch.Generator,
) -> list[Verdict]:
    """Verify every speculating request of a step at once: one gather of p_i(d_i) and q_i(d_i), one
    uniform per draft token, one draw per request from its residual (or bonus) distribution.
    Greedy requests compare argmaxes and draw nothing. Random draws per request come in the order
    the single-request walk takes them (its draft tokens' uniforms, then its last token)."""
    verdicts: list[Verdict | None] = [None] * len(proposals)
    greedy = [i for i, pr in enumerate(proposals) if rows[pr.first_row].request.params.greedy]
    if greedy:
        argmax = target_probs.argmax(-1).tolist()
        for i in greedy:
            pr = proposals[i]
            k, top = len(pr.draft_tokens), argmax[pr.first_row : pr.first_row + len(pr.draft_tokens) + 1]
            n = 0
            while n < k and pr.draft_tokens[n] == top[n]:
                n += 1
            verdicts[i] = Verdict(n, pr.draft_tokens[:n] + [top[n]])
    sampled = [i for i in range(len(proposals)) if verdicts[i] is None]
    if not sampled:
        return verdicts  # type: ignore[return-value]
    device = target_probs.device
    # accept d_i when u_i < p_i(d_i) / q_i(d_i), i.e. u_i * q_i(d_i) < p_i(d_i)
    p_rows, tokens, draft_rows = [], [], []
    for i in sampled:
        pr = proposals[i]
        p_rows += range(pr.first_row, pr.first_row + len(pr.draft_tokens))
        tokens += pr.draft_tokens
        draft_rows += rows[pr.first_row : pr.first_row + len(pr.draft_tokens)]
    token_index = torch.tensor(tokens, dtype=torch.long, device=device)
    p_d = target_probs[torch.tensor(p_rows, device=device), token_index]
    q_d = torch.cat([
        pr.draft_probs.gather(1, torch.tensor(pr.draft_tokens, device=device)[:, None])[:, 0]
        if pr.draft_probs is not None else torch.ones(len(pr.draft_tokens), device=device)
        for pr in (proposals[i] for i in sampled)
    ])
    u = uniform_noise(draft_rows, device, generator)
    rejected = (u * q_d >= p_d).tolist()
    # where each walk stops, and the distribution its last token comes from
    last_rows, residual_of = [], []  # target row of the last token; (proposal, rejected index) or None
    offset = 0
    for i in sampled:
        pr = proposals[i]
        k = len(pr.draft_tokens)
        walk = rejected[offset : offset + k]
        n = walk.index(True) if True in walk else k
        offset += k
        verdicts[i] = Verdict(n, pr.draft_tokens[:n])
        last_rows.append(pr.first_row + n)
        residual_of.append(None if n == k else (pr, n))
    p_last = target_probs[torch.tensor(last_rows, device=device)]  # [R, vocab]
    q_rejected = torch.zeros_like(p_last)  # q_n where the walk stopped at a rejection, else 0
    for j, item in enumerate(residual_of):
        if item is not None:
            pr, n = item
            if pr.draft_probs is not None:
                q_rejected[j] = pr.draft_probs[n]
            else:
                q_rejected[j, pr.draft_tokens[n]] = 1.0
    # at a rejection: norm(max(0, p - q)); after k acceptances (q row 0): p_(k+1) itself. The
    # residual sums to 0 only when p == q, where rejection has probability 0; keep p then
    residual = (p_last - q_rejected).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    dist = torch.where(total > 0, residual / total.clamp_min(1e-30), p_last)
    last = inverse_cdf(dist, [rows[r] for r in last_rows], generator).tolist()
    for i, token in zip(sampled, last):
        verdicts[i].tokens.append(token)
    return verdicts  # type: ignore[return-value]


def verify(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,  # [k, vocab] q_i; None for a one-hot proposer
    target_probs: torch.Tensor,  # [k + 1, vocab] p_i
    rows: list[SamplingRow],  # k + 1 rows of this request (for its generator)
    generator: torch.Generator,
) -> Verdict:
    """One request's verification (`verify_batch` for a batch of one)."""
    return verify_batch([Proposal(draft_tokens, draft_probs, 0)], target_probs, rows, generator)[0]
