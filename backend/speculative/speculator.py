"""Speculative decoding around the scheduler: reserve room, propose, record verifications.

Per step, before scheduling, `reserve` asks the speculation control (spec_control.py) for k per
decoding request and the scheduler for room for that many draft tokens
(`request.spec.num_lookahead_tokens`).
After scheduling, `propose` trims each reservation to what the token budget granted and asks the
proposer for the drafts. The target verifies them in the same forward as every other request's
tokens, the sampler accepts a prefix, and the engine calls `record`. What control learns about a
request (its acceptance counts) stays in the control, by request id, until the request is gone.

The cost model is fed after each step's read-back (`finish_step`), from spans the step timed on the
device's clock (step_timer.py: events on CUDA, no wait of their own): each draft forward, the
target's forward and the whole step, for decode-only steps. So adaptive k works alike with
overlapped steps, whose read-back comes one step later.

The draft reads at most `draft_budget` tokens (the target's budget) in a step's first forward.
In a step that speculates, it reads prompts alongside the target's prefill chunks; a request whose
draft is further behind than the budget left (speculation switched on after sitting out) does
not speculate until it has caught up, in chunks.
"""
from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

import numpy as np
import torch

from backend.core.request import Request
from backend.core.scheduler import ScheduledBatch
from backend.model.step_inputs import PendingTokens
from backend.speculative.proposer import Proposer
from backend.speculative.spec_control import SpecControl
from backend.step_timer import Mark, StepTimer


@dataclass(slots=True)
class SpecStep:
    """One step's plan and measurements, kept with the step until its tokens are back."""
    timer: StepTimer
    started: Mark
    expected: dict[str, np.ndarray] = field(default_factory=dict)  # request id -> E(0..max_k), as planned
    yield_correction: float = 0.0  # its verifications' expected minus realized yields
    catch_up_seconds: float | None = None  # its drafts caught up on what they missed: the cost of that
    probe: bool = False  # it drafts to measure speculation: its tokens count as they came, not as expected


class Speculator:
    def __init__(self, proposer: Proposer | None, max_k: int, adaptive: bool, device: torch.device, draft_budget: int,
                 live: Container[str] | None = None):
        self.proposer = proposer
        self.draft_budget = draft_budget  # tokens a step's first draft forward may read
        self.wants_drafts = False  # this step's plan gave some request k > 0: the draft reads
        # prompt chunks and the backlog of requests left behind alongside (within the budget)
        self.control = SpecControl(max_k, adaptive, free_drafts=proposer is not None and proposer.runner is None)
        self.live = live  # ids of the requests the engine still has (None: keep every request's counts)
        self.device = device
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.proposed_per_position = [0] * max_k  # draft position i -> tokens proposed there
        self.accepted_per_position = [0] * max_k  # draft position i -> tokens accepted there
        self.current: SpecStep | None = None  # the step being built

    @staticmethod
    def decode_only(batch: ScheduledBatch, lookahead: list[int]) -> bool:
        """Each request computes its last token plus its draft tokens, nothing else (no prompt)."""
        return all(n == 1 + k for n, k in zip(batch.num_scheduled_tokens, lookahead))

    def begin_step(self) -> SpecStep | None:
        """Start timing a step (None: nothing to time without a proposer)."""
        if self.proposer is None:
            self.current = None
            return None
        timer = StepTimer.for_device(self.device)
        self.current = SpecStep(timer, timer.mark())
        return self.current

    def observe_forward(self, step: SpecStep, batch: ScheduledBatch, lookahead: list[int], started: Mark) -> None:
        """Time the target's forward of a decode-only step for the cost model. Prompt chunks stay
        out: their per-token cost (many rows per matmul) is not what a verification token costs."""
        if self.decode_only(batch, lookahead):
            step.timer.span("target", (batch.total_tokens,), started)

    def end_step(self, step: SpecStep, batch: ScheduledBatch, lookahead: list[int]) -> None:
        """The step is sampled (on the device): time it whole, if it was decode-only."""
        if self.decode_only(batch, lookahead):
            step.timer.span("step", (any(lookahead), len(batch.requests)), step.started)

    def finish_step(self, step: SpecStep, num_new_tokens: int) -> None:
        """The step's tokens are on the host (and its verifications recorded): feed its spans."""
        for span in step.timer.spans:
            seconds = StepTimer.seconds(span)
            if span.kind == "draft":
                self.control.observe_draft_forward(*span.sizes, seconds)
            elif span.kind == "target":
                self.control.observe_target_forward(*span.sizes, seconds)
            else:
                speculating, num_requests = span.sizes
                tokens = num_new_tokens + (0.0 if step.probe else step.yield_correction)
                self.control.observe_step(bool(speculating), num_requests, tokens, seconds, step.catch_up_seconds)

    def reserve(self, running: list[Request], max_model_len: int) -> None:
        """Choose k per decoding request and reserve room for its draft tokens (the plan's expected
        yields go with the step being built, `begin_step`)."""
        self.wants_drafts = False
        if self.proposer is None:
            return
        if self.live is not None and len(self.control.survival) > len(self.live):
            self.control.forget_all_but(self.live)  # so at most as many stale counts as live requests
        # decoding: everything computed but the last token (known, or still on the device)
        candidates = [r for r in running
                      if r.params.speculative and r.num_computed_tokens == r.num_tokens + r.num_pending_tokens - 1]
        budget = self.draft_budget
        ks, expected = self.control.plan(candidates, len(running))
        if self.current is not None:
            self.current.probe = self.control.probing
        for i, (r, k) in enumerate(zip(candidates, ks)):
            # never verify past max_tokens or the context (tokens on the device counted as landed)
            num_tokens = r.num_tokens + r.num_pending_tokens
            k = min(k, r.params.max_tokens - r.num_output_tokens - r.num_pending_tokens - 1, max_model_len - num_tokens)
            if k <= 0:
                continue
            self.wants_drafts = True
            k = self.proposer.num_available(r, k)
            if self.proposer.runner is not None:
                behind = self.proposer.behind(r)
                if behind > budget:  # it catches up first (`propose` reads what budget is left)
                    continue
                budget -= behind
            r.spec.num_lookahead_tokens = k
            if expected is not None and self.current is not None:
                self.current.expected[r.request_id] = expected[i]

    def propose(self, batch: ScheduledBatch, running: list[Request],
                pending: PendingTokens | None = None) -> dict[str, torch.Tensor | None]:
        """Fit the reservations to what was scheduled, then propose (`pending`: last step's tokens,
        still on the device). Returns the draft distributions by request id (None: one-hot on the
        drafts); the drafts go to `request.spec`."""
        if self.proposer is None:
            return {}
        to_draft, ks = [], []
        scheduled = set()
        for r, n in zip(batch.requests, batch.num_scheduled_tokens):
            scheduled.add(r.request_id)
            if not r.spec.num_lookahead_tokens:
                continue
            k = n - (r.num_tokens + r.num_pending_tokens - r.num_computed_tokens)  # the budget may have cut it short
            r.spec.num_lookahead_tokens = max(k, 0)
            if k > 0:
                to_draft.append(r)
                ks.append(k)
        for r in running:  # reserved but not scheduled this step
            if r.spec.num_lookahead_tokens and r.request_id not in scheduled:
                r.spec.num_lookahead_tokens, r.spec.draft_token_ids = 0, []
        catch_up = []
        if self.proposer.runner is not None and self.wants_drafts:
            behind = sum(self.proposer.behind(r) for r in to_draft)
            catch_up = self._catch_up_rows(batch, self.draft_budget - behind)
            # a draft that sat out steps (or is new) first reads what it missed; when that dominates
            # the step, its cost beyond a usual first forward is estimated for the mode chooser
            behind += sum(end - r.spec.num_computed_tokens for r, end in catch_up)
            if self.current is not None:
                self.current.catch_up_seconds = self.control.catch_up_seconds(behind, usual=sum(k + 1 for k in ks))
        if not to_draft and not catch_up:
            return {}
        probs = {}
        timer = self.current.timer if self.current is not None else None
        proposals = self.proposer.propose(to_draft, ks, timer, catch_up, pending)
        for r, proposal in zip(to_draft, proposals):
            r.spec.draft_token_ids, r.spec.proposal = proposal.token_ids, proposal
            probs[r.request_id] = proposal.probs
        return probs

    def _catch_up_rows(self, batch: ScheduledBatch, budget: int) -> list[tuple[Request, int]]:
        """(request, end) for requests of this step that do not speculate and whose draft is behind
        (a prompt chunk, or tokens missed while speculation was off): the draft reads up to `end`,
        as far as the proposer can (`catch_up_end`: a draft model alongside the target's chunk,
        short of the last known token; an EAGLE head to what the target has computed), at most
        `budget` tokens in all."""
        rows = []
        for r, n in zip(batch.requests, batch.num_scheduled_tokens):
            if budget <= 0:
                break
            start = r.spec.num_computed_tokens
            end = min(self.proposer.catch_up_end(r, n), start + budget)
            if r.spec.num_lookahead_tokens or not r.params.speculative or end <= start:
                continue
            rows.append((r, end))
            budget -= end - start
        return rows

    def record(self, step: SpecStep, request: Request, k: int, num_accepted: int) -> None:
        """A verification of the step came back: k drafts, the first num_accepted kept."""
        expected = step.expected.pop(request.request_id, None)
        if expected is not None:  # outside probes the mode chooser counts a verification by its expected yield
            step.yield_correction += expected[k] - (num_accepted + 1)
        self.control.observe_verification(request.request_id, k, num_accepted)
        request.spec.num_draft_tokens += k
        request.spec.num_accepted_tokens += num_accepted
        self.num_draft_tokens += k
        self.num_accepted_tokens += num_accepted
        for i in range(k):
            self.proposed_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted
