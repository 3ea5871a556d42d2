"""A request's speculative decoding, as data: the drafts proposed for it, the draft's progress
through it and its totals. The speculator (backend/speculative/) writes it; it sits with the request so
that the scheduler and the step inputs can see the drafts to verify. What the speculation control
learns about a request (its acceptance counts) is the control's (backend/speculative/spec_control.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(slots=True)
class SpecState:
    """A request's speculative decoding, kept by the speculator; reset when it is preempted (its
    draft KV goes with its blocks), totals kept."""
    # draft tokens to verify this step; None while they are on the device only (`proposal`)
    draft_token_ids: list[int] | None = field(default_factory=list)
    proposal: Proposal | None = None  # the draft model's, as proposed (tokens on the device too)
    num_lookahead_tokens: int = 0  # draft tokens the scheduler reserves room for this step
    num_computed_tokens: int = 0  # tokens whose K/V are in the draft model's pool
    num_draft_tokens: int = 0  # drafted so far
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def drafted_ahead(self) -> bool:
        """Drafted from last step's tokens before they reached the host (its draft's count then
        assumes every verified draft was accepted)."""
        return self.draft_token_ids is None

    def drop_drafts(self) -> None:
        """The draft's KV is gone (preemption): nothing reserved, nothing to verify, read again."""
        self.draft_token_ids, self.num_lookahead_tokens, self.num_computed_tokens = [], 0, 0
        self.proposal = None
