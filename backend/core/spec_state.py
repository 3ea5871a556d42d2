"""A request's speculative decoding, as data: the drafts proposed for it, its acceptance counts
and the draft's progress through it. The speculator (backend/spec/) reads and writes it; it sits
with the request so that the scheduler and the step inputs can see the drafts to verify."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from backend.host_copy import HostCopy


@dataclass(slots=True)
class Proposal:
    token_ids: list[int] | None  # d_1..d_k; None while they are on the device only
    probs: torch.Tensor | None  # [k, vocab] q_1..q_k; None: one-hot on the tokens (prompt lookup), or
    # a greedy request (its verification compares argmaxes)
    device_token_ids: torch.Tensor | None = None  # [k] int64 on the device (the draft model's)
    host_copy: tuple[HostCopy, int] | None = None  # the tokens on their way to the host (copy, offset)

    def host_token_ids(self) -> list[int]:
        if self.token_ids is None:
            copy, offset = self.host_copy
            self.token_ids = copy.values()[0][offset : offset + len(self.device_token_ids)]
        return self.token_ids


class Survival:
    """Decayed counts, per draft position i: verifications that drafted it, and how many of
    those accepted every token up to and including it."""

    def __init__(self, max_k: int):
        self.reached = np.zeros(max_k)
        self.survived = np.zeros(max_k)

    def add(self, num_draft: int, num_accepted: int, decay: float) -> None:
        self.reached *= decay
        self.survived *= decay
        self.reached[:num_draft] += 1
        self.survived[:num_accepted] += 1

    def curve(self, prior_count: float, prior: float) -> np.ndarray:
        """s_1..s_max_k: the counts shrunk toward a prior, never rising with i. Position 1's prior
        is `prior` and each later position's continues the previous conditional rate
        s_i / s_(i-1): a position rarely drafted is judged by the ones before it, not by a
        constant that would keep it from ever being drafted."""
        s = np.empty_like(self.reached)
        previous, conditional = 1.0, prior
        for i in range(len(s)):
            guess = previous * conditional
            s[i] = min((self.survived[i] + prior_count * guess) / (self.reached[i] + prior_count), previous)
            conditional = s[i] / previous if previous > 0 else 0.0
            previous = s[i]
        return s


@dataclass(slots=True)
class SpecState:
    """A request's speculative decoding, kept by the speculator; reset when it is preempted (its
    draft KV goes with its blocks), counters and measurements kept."""
    # draft tokens to verify this step; None while they are on the device only (`proposal`)
    draft_token_ids: list[int] | None = field(default_factory=list)
    proposal: Proposal | None = None  # the draft model's, as proposed (tokens on the device too)
    num_lookahead_tokens: int = 0  # draft tokens the scheduler reserves room for this step
    num_computed_tokens: int = 0  # tokens whose K/V are in the draft model's pool
    num_draft_tokens: int = 0  # drafted so far
    num_accepted_tokens: int = 0  # of those, accepted
    survival: Survival | None = None  # its own acceptance counts, once it has verified drafts
    expected_yield: np.ndarray | None = None  # E(0..max_k) as this step's plan expects it

    @property
    def drafted_ahead(self) -> bool:
        """Drafted from last step's tokens before they reached the host (its draft's count then
        assumes every verified draft was accepted)."""
        return self.draft_token_ids is None

    def drop_drafts(self) -> None:
        """The draft's KV is gone (preemption): nothing reserved, nothing to verify, read again."""
        self.draft_token_ids, self.num_lookahead_tokens, self.num_computed_tokens = [], 0, 0
        self.proposal = None
