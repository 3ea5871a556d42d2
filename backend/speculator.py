"""Speculative decoding around the scheduler: reserve room, propose, record verifications.

Per step, before scheduling, `reserve` picks k for every decoding request (SpecController) and
asks the scheduler for room for k draft tokens (`num_lookahead_tokens`; the n-gram proposer
fills its tokens right away). After scheduling, `propose` trims each reservation to what the
token budget granted and runs the draft model. The target verifies in the same forward as every
other request's tokens; the engine runs the rejection sampler and calls `record`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from backend.draft_proposer import DraftProposer
from backend.ngram_proposer import NgramProposer
from backend.request import Request
from backend.scheduler import ScheduledBatch
from backend.spec_controller import LinearCost, SpecController


class Speculator:
    def __init__(self, proposer: DraftProposer | NgramProposer | None, max_k: int, adaptive: bool, device: torch.device):
        self.proposer = proposer
        self.controller = SpecController(max_k, adaptive)
        self.device = device
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.proposed_per_position = [0] * max_k  # draft position i -> tokens proposed there
        self.accepted_per_position = [0] * max_k  # draft position i -> tokens accepted there

    @contextmanager
    def timed(self, cost: LinearCost, num_tokens: int):
        """Add the block's wall time (device work included) to a cost model."""
        started = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        cost.add(num_tokens, time.perf_counter() - started)

    def reserve(self, running: list[Request], max_model_len: int) -> None:
        """Choose k per decoding request and reserve room for its draft tokens."""
        if self.proposer is None:
            return
        candidates = [r for r in running if r.params.speculative and r.num_computed_tokens == r.num_tokens - 1]
        for r, k in zip(candidates, self.controller.plan(candidates)):
            # never verify past max_tokens or the context
            k = min(k, r.params.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens)
            if k <= 0:
                continue
            if isinstance(self.proposer, NgramProposer):
                r.spec_token_ids = self.proposer.lookup(r.all_token_ids, k)
                r.num_lookahead_tokens = len(r.spec_token_ids)
            else:
                r.num_lookahead_tokens = k

    def propose(self, batch: ScheduledBatch, running: list[Request]) -> dict[str, torch.Tensor]:
        """Fit the reservations to what was scheduled, then run the draft model. Returns the
        draft distributions by request id (none for the n-gram proposer)."""
        if self.proposer is None:
            return {}
        to_draft, ks = [], []
        scheduled = set()
        for r, n in zip(batch.requests, batch.num_scheduled_tokens):
            scheduled.add(r.request_id)
            if not r.num_lookahead_tokens:
                continue
            k = n - (r.num_tokens - r.num_computed_tokens)  # the budget may have cut it short
            r.num_lookahead_tokens = max(k, 0)
            r.spec_token_ids = r.spec_token_ids[: r.num_lookahead_tokens]
            if k > 0 and isinstance(self.proposer, DraftProposer):
                to_draft.append(r)
                ks.append(k)
        for r in running:  # reserved but not scheduled this step
            if r.num_lookahead_tokens and r.request_id not in scheduled:
                r.num_lookahead_tokens, r.spec_token_ids = 0, []
        if not to_draft:
            return {}
        with self.timed(self.controller.draft_cost, len(to_draft)):
            proposals = self.proposer.propose(to_draft, ks)
        # the cost model is per draft forward: spread the k forwards' time
        n, seconds = self.controller.draft_cost.samples.pop()
        self.controller.draft_cost.add(n, seconds / max(ks))
        probs = {}
        for r, (tokens, q) in zip(to_draft, proposals):
            r.spec_token_ids = tokens
            probs[r.request_id] = q
        return probs

    def record(self, request: Request, k: int, num_accepted: int) -> None:
        self.controller.observe(request, k, num_accepted)
        self.num_draft_tokens += k
        self.num_accepted_tokens += num_accepted
        for i in range(k):
            self.proposed_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted
