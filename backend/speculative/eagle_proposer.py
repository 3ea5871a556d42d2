"""EAGLE-head proposer: the head (backend/model/eagle.py) drafts from the target's own hidden states.

The head's position t holds (f_t, x_{t+1}): it stays one position behind the target's tokens,
since x_{t+1} must be known and f_t computed. `request.spec.num_computed_tokens` says how far its
KV is valid. The first forward of a step reads, for each request that speculates, positions
[num_computed, num_tokens - 1) (the last step's accepted drafts and bonus token, f from the
target's feature pool); its last row drafts d_1 = x_{num_tokens}. Then k - 1 chained forwards,
each at the next position, fed the token the one before drew and its f^ (the head's guess at the
target's hidden state there). Those chained positions are guesses: the head's KV is kept only up
to its first forward's rows, and the next step reads the verified positions again with the
target's true features. Catch-up rows (requests that do not speculate this step, prompts) read
only positions the target has computed before this step: their features exist.

Steps are plain (no overlapped steps: the engine refuses them with an EAGLE head), so every input
is on the host.
"""
from __future__ import annotations

import torch

from backend.core.request import Request
from backend.core.spec_state import Proposal
from backend.model.model_runner import StepInput
from backend.speculative.draft_proposer import DraftProposer, Drafts
from backend.step_timer import StepTimer


class EagleProposer(DraftProposer):
    """A DraftProposer (the same sampling of drafts, the same proposals) whose model is a head."""

    @staticmethod
    def behind(request: Request) -> int:
        """Positions a speculating request's first forward reads: up to the one before its last token."""
        return request.num_tokens - 1 - request.spec.num_computed_tokens

    @staticmethod
    def catch_up_end(request: Request, num_scheduled: int) -> int:
        """How far a request's head KV can catch up before this step: to what the target computed."""
        return min(request.num_computed_tokens, request.num_tokens - 1)

    def propose(self, requests: list[Request], ks: list[int], timer: StepTimer | None = None,
                catch_up: list[tuple[Request, int]] = (), pending=None) -> list[Proposal]:
        if pending is not None:
            raise RuntimeError("an EAGLE head drafts from tokens on the host: overlapped steps are refused")
        drafts = Drafts(requests, ks, self.runner.device)
        previous: torch.Tensor | None = None  # the last forward's draws, [len(active)]
        hidden: torch.Tensor | None = None  # and its f^, [len(active), hidden]
        previous_active: list[int] = []
        for j in range(max(ks, default=1)):
            started = timer.mark() if timer is not None else None
            active = [i for i, k in enumerate(ks) if k > j]
            features = None  # the first forward reads the target's, by KV slot
            if j == 0:
                step = StepInput([], [], [], [])
                for i in active:
                    r = requests[i]
                    end = r.num_tokens - 1
                    start = min(r.spec.num_computed_tokens, end - 1)  # at least the row that drafts
                    step.add(r.tokens_slice(start + 1, end + 1), start, r.block_table, 1)
                    r.spec.num_computed_tokens = end
                for r, end in catch_up:
                    start = r.spec.num_computed_tokens
                    step.add(r.tokens_slice(start + 1, end + 1), start, r.block_table, 0)
                    r.spec.num_computed_tokens = end
            else:  # the next position: the token the forward before drew, and its f^
                step = StepInput([], [], [], [], device_tokens=previous)
                rows = [previous_active.index(i) for i in active]
                for i, row in zip(active, rows):
                    r = requests[i]
                    step.add([0], r.num_tokens - 2 + j, r.block_table, 1)
                    step.take_from_device([row])
                features = hidden[rows]
            logits, f_hat = self.runner.run(step, features)
            if active:
                previous = self.draw(requests, active, self.full_vocabulary(logits), drafts, j)
                hidden, previous_active = f_hat, active
            if timer is not None:
                timer.span("draft", (j, sum(len(t) for t in step.token_ids), len(active)), started)
        return drafts.proposals(self.runner.waits, {})
