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


EXPLORE_EVERY = 16  # steps: how often the mode that looks worse is tried again
RATE_EMA = 0.1  # weight of the newest step in a measured decode rate


class ModeChooser:
    """Measures what speculation actually buys: decode-only steps' output tokens per second with
    speculation and without, per batch-size bucket (moving averages), and picks the faster mode,
    trying the other one every EXPLORE_EVERY steps. It catches every cost the S(k) model leaves
    out (verification bookkeeping, draft catch-up), so a loaded server does not get slower."""

    def __init__(self) -> None:
        self.rates: dict[tuple[bool, int], float] = {}  # (speculating, bucket) -> tokens/s
        self.steps = 0

    @staticmethod
    def bucket(num_requests: int) -> int:
        return max(num_requests, 1).bit_length()  # 1, 2-3, 4-7, ...

    def speculate(self, num_requests: int) -> bool:
        self.steps += 1
        b = self.bucket(num_requests)
        on, off = self.rates.get((True, b)), self.rates.get((False, b))
        if on is None or off is None:
            return on is None  # measure both first
        better = on >= off
        return better if self.steps % EXPLORE_EVERY else not better

    def observe(self, speculating: bool, num_requests: int, num_tokens: int, seconds: float) -> None:
        key = (speculating, self.bucket(num_requests))
        rate = num_tokens / max(seconds, 1e-9)
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else (1 - RATE_EMA) * old + RATE_EMA * rate


class Speculator:
    def __init__(self, proposer: DraftProposer | NgramProposer | None, max_k: int, adaptive: bool, device: torch.device):
        self.proposer = proposer
        self.controller = SpecController(max_k, adaptive)
        self.modes = ModeChooser()
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
        if self.controller.adaptive and candidates and not self.modes.speculate(len(running)):
            return
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

    def observe_step(self, batch: ScheduledBatch, lookahead: list[int], num_new_tokens: int, seconds: float) -> None:
        """Feed a decode-only step (each request computes its last token plus its `lookahead`
        draft tokens, nothing else) to the mode chooser."""
        if self.proposer is None or not self.controller.adaptive:
            return
        if any(n != 1 + k for n, k in zip(batch.num_scheduled_tokens, lookahead)):
            return
        self.modes.observe(any(lookahead), len(batch.requests), num_new_tokens, seconds)

    def record(self, request: Request, k: int, num_accepted: int) -> None:
        self.controller.observe(request, k, num_accepted)
        self.num_draft_tokens += k
        self.num_accepted_tokens += num_accepted
        for i in range(k):
            self.proposed_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted
