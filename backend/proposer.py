"""What speculation asks of a proposer: the draft model (draft_proposer.py) or prompt lookup
(ngram_proposer.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from backend.host_copy import HostCopy
from backend.model_runner import ModelRunner
from backend.request import Request
from backend.step_timer import StepTimer

if TYPE_CHECKING:
    from backend.step_inputs import PendingTokens


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


class Proposer(Protocol):
    # the draft model's runner: its forwards cost time and its KV must catch up on what it has not
    # read; None when proposing costs no forward
    runner: ModelRunner | None

    def num_available(self, request: Request, k: int) -> int:
        """How many of k draft tokens it can propose for the request now (before scheduling)."""

    def propose(self, requests: list[Request], ks: list[int], timer: StepTimer | None = None,
                catch_up: list[tuple[Request, int]] = (), pending: PendingTokens | None = None) -> list[Proposal]:
        """Exactly ks[i] draft tokens for requests[i] (at most what num_available said). A
        proposer with a runner also reads the `catch_up` rows: (request, end), its KV up to end,
        and times each forward j on `timer` as a span ("draft", (j, num_tokens, num_requests))."""
