"""What speculation asks of a proposer: the draft model (draft_proposer.py) or prompt lookup
(ngram_proposer.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from backend.core.request import Request
from backend.core.spec_state import Proposal
from backend.model.model_runner import ModelRunner
from backend.step_timer import StepTimer

if TYPE_CHECKING:
    from backend.model.step_inputs import PendingTokens


class Proposer(Protocol):
    # the draft model's runner: its forwards cost time and its KV must catch up on what it has not
    # read; None when proposing costs no forward
    runner: ModelRunner | None

    def num_available(self, request: Request, k: int) -> int:
        """How many of k draft tokens it can propose for the request now (before scheduling)."""

    # with a runner: the tokens a speculating request's first forward reads, and how far a request
    # that does not speculate can catch up in a step that computes num_scheduled of its tokens
    def behind(self, request: Request) -> int: ...

    def catch_up_end(self, request: Request, num_scheduled: int) -> int: ...

    def propose(self, requests: list[Request], ks: list[int], timer: StepTimer | None = None,
                catch_up: list[tuple[Request, int]] = (), pending: PendingTokens | None = None) -> list[Proposal]:
        """Exactly ks[i] draft tokens for requests[i] (at most what num_available said). A
        proposer with a runner also reads the `catch_up` rows: (request, end), its KV up to end,
        and times each forward j on `timer` as a span ("draft", (j, num_tokens, num_requests))."""
