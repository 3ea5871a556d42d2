"""What speculation asks of a proposer: the draft model (draft_proposer.py) or prompt lookup
(ngram_proposer.py)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from backend.model_runner import ModelRunner
from backend.request import Request

# clock(j, num_tokens, num_requests, start time): called after the j-th draft forward
DraftClock = Callable[[int, int, int, float], None]


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]  # d_1..d_k
    probs: torch.Tensor | None  # [k, vocab] q_1..q_k; None: one-hot on the tokens (prompt lookup), or
    # a greedy request (its verification compares argmaxes)


class Proposer(Protocol):
    # the draft model's runner: its forwards cost time and its KV must catch up on what it has not
    # read; None when proposing costs no forward
    runner: ModelRunner | None

    def num_available(self, request: Request, k: int) -> int:
        """How many of k draft tokens it can propose for the request now (before scheduling)."""

    def propose(self, requests: list[Request], ks: list[int], clock: DraftClock | None = None,
                catch_up: list[tuple[Request, int]] = ()) -> list[Proposal]:
        """Exactly ks[i] draft tokens for requests[i] (at most what num_available said). A
        proposer with a runner also reads the `catch_up` rows: (request, end), its KV up to end."""
