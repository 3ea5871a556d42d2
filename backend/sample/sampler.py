"""Turn a step's logits into tokens, on the logits' device: penalties, temperature, top-k, top-p,
min-p, seeded draws, and the verification of draft tokens (rejection_sampler.py), in one call.

Rows, draws and per-request faults are laid out by backend/sample/sampling_metadata.py. Sampling is
exact: a seeded row by the exponential race on noise keyed on (seed, output index)
(seeded_noise.py), an unseeded one by inverse-CDF sampling, one uniform draw per token. Nothing
here reads back to the host: the engine copies `SamplerOutput` back asynchronously.

Guided decoding: a constrained row's logits are set to -inf where its grammar forbids the token,
before temperature and the filters, so the row samples from p' = norm(p * m), m the row's 0/1
mask (greedy: the argmax of the masked logits). With speculation the drafts are verified against
p' exactly as against p (rejection_sampler.py): draft d_i, drawn from any q_i, is kept with
probability min(1, p'_i(d_i) / q_i(d_i)), and a rejection draws from norm(max(0, p'_i - q_i)), so
each kept token is distributed as p'_i. A draft the grammar forbids has p'_i(d_i) = 0 and is always
rejected, and the residual is 0 wherever p'_i is, so no forbidden token is ever drawn. So
constrained speculative output follows the constrained target exactly, and greedy constrained
output is the same with and without speculation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar

from backend.sample.rejection_sampler import (
    PLACEHOLDER_TOKEN,
    inverse_cdf,
    rejection_sample,
)
from backend.sample.sampling_metadata import SamplingMetadata
from backend.sample.seeded_noise import keyed_sample
from backend.uploads import on_device


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties, the EOS/stop-token mask before min_tokens,
    then the grammars' masks (guided decoding). logits: [R, vocab] float32, changed in place."""
    pen = meta.penalties
    if pen is not None:
        counts = torch.zeros_like(logits).index_put_(
            (pen.output_rows, pen.output_tokens), torch.ones_like(pen.output_rows, dtype=logits.dtype),
            accumulate=True,
        )  # [R, vocab] output occurrences
        seen = (counts > 0).index_put_((pen.prompt_rows, pen.prompt_tokens),
                                       torch.ones_like(pen.prompt_rows, dtype=torch.bool))
        rp = pen.repetition[:, None]
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits))
        logits -= pen.frequency[:, None] * counts + pen.presence[:, None] * (counts > 0)
    if meta.banned_rows is not None:
        # new_full is a fill on the device: no copy from pageable host memory, no wait
        logits.index_put_((meta.banned_rows, meta.banned_tokens), logits.new_full((), float("-inf")))
    if meta.grammar_bitmask is not None:  # tokens the grammar forbids: -inf
        xgrammar.apply_token_bitmask_inplace(logits, meta.grammar_bitmask, vocab_size=logits.shape[1],
                                             indices=meta.grammar_rows)
    return logits


def probs_from_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each row samples from: [R, vocab] float32 (temperature, top-k, top-p,
    min-p). A greedy row's is not used: it takes its argmax."""
    vocab = logits.shape[1]
    x = logits / meta.temperature[:, None]
    if meta.top_k is not None:
        sorted_x, order = x.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=x.device)[None, :]
        drop = rank >= meta.top_k[:, None]
        sorted_probs = sorted_x.masked_fill(drop, float("-inf")).softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop |= mass_before >= meta.top_p[:, None]  # keeps the top token
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    if meta.min_p is not None:
        keep = probs >= meta.min_p[:, None] * probs.max(-1, keepdim=True).values
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclass(slots=True)
class Logprobs:
    """Log-probabilities of the model's raw distribution at `rows` (host list): the chosen
    token's and its rank (1: the most likely) [len(rows)], and the top-n values and ids
    [len(rows), n]."""
    rows: list[int]
    chosen: torch.Tensor
    chosen_rank: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.chosen, self.chosen_rank, self.top_values, self.top_ids

    def entries(self) -> dict[int, tuple[float, int, list[int], list[float]]]:
        """Row -> (the chosen token's logprob, its rank, top ids, top logprobs), from host tensors."""
        chosen, ranks = self.chosen.tolist(), self.chosen_rank.tolist()
        ids, values = self.top_ids.tolist(), self.top_values.tolist()
        return {row: (chosen[j], ranks[j], ids[j], values[j]) for j, row in enumerate(self.rows)}


@dataclass(slots=True)
class SamplerOutput:
    """A step's sampled tokens, on the device until the engine copies them back (HostCopy)."""
    token_ids: torch.Tensor  # [B, max_k + 1] int64: accepted drafts, then the recovered or bonus
    # token, then PLACEHOLDER_TOKEN; a request without drafts has its one token in column 0
    probs: torch.Tensor | None  # [R, vocab] the distributions sampled from; None when all greedy
    logprobs: Logprobs | None


class Sampler:
    """Every token the engine emits or the draft proposes goes through one call. Holds the
    engine's generator, which requests without a seed draw from (sampling_metadata.py)."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,  # [R, vocab] float32; penalties change it in place
        meta: SamplingMetadata,
        draft_probs: torch.Tensor | None = None,  # [D, vocab] q of each draft token; None: one-hot
    ) -> SamplerOutput:
        raw = logits.clone() if meta.logprob_rows else None
        x = apply_penalties(logits, meta)
        probs = None if meta.all_greedy else probs_from_logits(x, meta)
        decided = x.argmax(-1) if meta.any_greedy else None  # [R] greedy rows' tokens ...
        if meta.seeded_rows is not None:  # ... and seeded rows' (seeded_noise.py)
            keyed = keyed_sample(probs.index_select(0, meta.seeded_rows), meta.seeded_keys)
            decided = (decided if decided is not None else keyed.new_zeros(x.shape[0])).index_copy(
                0, meta.seeded_rows, keyed)
        token_ids = rejection_sample(decided, probs if meta.any_drawn else None, draft_probs, meta)
        logprobs = None
        if raw is not None:
            rows = on_device(meta.logprob_rows, raw.device, torch.int64)
            logp = torch.log_softmax(raw.index_select(0, rows), dim=-1)
            chosen_tokens = token_ids.view(-1)[meta.row_slot.index_select(0, rows)].clamp_min(0)  # placeholder: unread
            chosen = logp.gather(1, chosen_tokens[:, None])[:, 0]
            rank = (logp > chosen[:, None]).sum(-1) + 1
            top = logp.topk(max(meta.max_logprobs, 1), dim=-1)
            logprobs = Logprobs(meta.logprob_rows, chosen, rank, top.values, top.indices)
        return SamplerOutput(token_ids, probs, logprobs)


__all__ = ["PLACEHOLDER_TOKEN", "Logprobs", "Sampler", "SamplerOutput", "apply_penalties", "inverse_cdf",
           "probs_from_logits"]
