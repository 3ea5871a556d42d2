"""Speculative decoding around the scheduler: reserve room, propose, record verifications.

Per step, before scheduling, `reserve` picks k for every decoding request (SpecController) and
asks the scheduler for room for k draft tokens (`num_lookahead_tokens`; the n-gram proposer
fills its tokens right away). After scheduling, `propose` trims each reservation to what the
token budget granted and runs the draft model. The target verifies in the same forward as every
other request's tokens; the engine runs the rejection sampler and calls `record`.

The draft reads at most `draft_budget` tokens (the target's budget) in a step's first forward.
In a step that speculates, it reads prompts alongside the target's prefill chunks; a request whose
draft is further behind than the budget left (speculation switched on after sitting out) does
not speculate until it has caught up, in chunks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from backend.proposer import Proposer
from backend.request import Request
from backend.scheduler import ScheduledBatch
from backend.spec_controller import SpecController


EXPLORE_EVERY = 32  # steps before the mode that looks worse is tried again ...
EXPLORE_STEPS = 4  # ... for this many steps in a row (one speculative step's yield is too noisy);
MAX_EXPLORE_EVERY = 128  # each burst that confirms the choice doubles the wait, up to this
WARMUP_SAMPLES = 4  # steps of each mode measured (alternating) before the rates are compared
DECAY = 0.9  # per step measured in a mode, weight kept by that mode's earlier steps
SWITCH_BUDGET = 0.03  # bursts that switch speculation on spend at most this share of the time on catch-ups


@dataclass(slots=True)
class _Bucket:
    steps: int = 0  # decisions made for this batch-size bucket
    explore_at: int = EXPLORE_EVERY  # step at which the next exploration burst starts
    interval: int = EXPLORE_EVERY
    preferred: bool = True  # the choice when the current burst started
    speculating: bool = False  # the last choice outside bursts
    steady: bool = False  # this step speculates, as the one before did (no switch, no burst)
    last_burst: int = 0  # step at which the last exploration burst ended
    burst_extension: int = 0  # steps the current burst spent catching up, added to its length
    switch_seconds: float = 0.0  # measured cost of switching speculation on (the drafts' catch-up) ...
    switch_accrued: float = 0.0  # ... and of the switch under way, which may take several steps

    @property
    def switch_cost(self) -> float:
        return max(self.switch_seconds, self.switch_accrued)

    def in_burst(self) -> bool:
        return self.explore_at <= self.steps < self.explore_at + EXPLORE_STEPS + self.burst_extension


class ModeChooser:
    """Measures what speculation actually buys: decode-only steps' output tokens per second with
    speculation and without, per batch-size bucket, and picks the faster mode. The other mode is
    tried again in bursts of EXPLORE_STEPS steps; a burst that confirms the choice doubles the
    wait before the next (a settled choice costs little exploration), one that overturns it
    resets the wait. It catches every cost the S(k) model leaves out (verification bookkeeping,
    draft catch-up), so a loaded server does not get slower. A rate is decayed tokens over
    decayed seconds (not an average of per-step rates, which a speculative step's 1-or-k+1
    tokens would bias)."""

    def __init__(self) -> None:
        self.totals: dict[tuple[bool, int], list[float]] = {}  # (speculating, bucket) -> [tokens, seconds]
        self.samples: dict[tuple[bool, int], int] = {}  # (speculating, bucket) -> steps measured
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(num_requests: int) -> int:
        return max(num_requests, 1).bit_length()  # 1, 2-3, 4-7, ...

    def rate(self, speculating: bool, num_requests: int) -> float | None:
        """Measured tokens/s of a mode at this batch size; None before any measurement."""
        key = (speculating, self.bucket(num_requests))
        return self._rate(key) if key in self.totals else None

    def _rate(self, key: tuple[bool, int]) -> float:
        tokens, seconds = self.totals[key]
        return tokens / max(seconds, 1e-9)

    def _warm(self, b: int) -> bool:
        return min(self.samples.get((True, b), 0), self.samples.get((False, b), 0)) >= WARMUP_SAMPLES

    def _faster(self, b: int, num_requests: int) -> bool | None:
        """Is speculation faster in bucket b? Judged by the bucket itself once both modes are
        measured there, meanwhile by a measured neighbour (batch sizes change as requests come
        and go); None when neither can tell. Switching speculation on costs the drafts' catch-up
        on what they missed, so from plain decoding it must win by enough to earn that back
        before the next exploration burst (a tie goes to plain decoding)."""
        state = self.buckets[b]
        for candidate in (b, b - 1, b + 1):
            if self._warm(candidate):
                on, off = self._rate((True, candidate)), self._rate((False, candidate))
                if state.speculating:
                    return on > off
                step_seconds = num_requests / max(off, 1e-9)  # a plain step yields a token per request
                return on > off * (1 + state.switch_cost / (state.interval * step_seconds))
        return None

    def steady(self, num_requests: int) -> bool:
        """The latest choice at this batch size kept speculation on (not a switch, not a burst)."""
        state = self.buckets.get(self.bucket(num_requests))
        return state is not None and state.steady

    def charge_switch(self, num_requests: int, seconds: float) -> None:
        """A step of switching speculation on in this bucket: the drafts' catch-up beyond their
        usual work (it takes several steps when the drafts are further behind than a step's
        budget). A burst does not count such steps: it measures speculation once caught up."""
        state = self.buckets.setdefault(self.bucket(num_requests), _Bucket())
        state.switch_accrued += seconds
        if state.in_burst():
            state.burst_extension += 1

    def _settle_switch(self, state: _Bucket) -> None:
        """The switch under way is over: fold its cost into the running mean."""
        if state.switch_accrued:
            seconds = state.switch_accrued
            state.switch_seconds = 0.5 * state.switch_seconds + 0.5 * seconds if state.switch_seconds else seconds
            state.switch_accrued = 0.0

    def speculate(self, num_requests: int) -> bool:
        b = self.bucket(num_requests)
        state = self.buckets.setdefault(b, _Bucket())
        state.steps += 1
        better = self._faster(b, num_requests)
        state.steady = False
        if better is None:  # nothing measured here or nearby: measure both, alternating
            n_on, n_off = self.samples.get((True, b), 0), self.samples.get((False, b), 0)
            return n_on < n_off or (n_on == n_off and state.steps % 2 == 1)
        off_rate = self.rate(False, num_requests)
        if state.steps == state.explore_at and not better and state.switch_cost and off_rate:
            # trying speculation again costs a catch-up: keep such bursts to SWITCH_BUDGET of the
            # time (a plain step takes num_requests / off_rate seconds)
            gap = int(state.switch_cost * off_rate / (SWITCH_BUDGET * num_requests))
            state.explore_at = max(state.explore_at, state.last_burst + gap)
        burst_end = state.explore_at + EXPLORE_STEPS + state.burst_extension
        if state.steps == state.explore_at:
            state.preferred = better
        if state.explore_at <= state.steps < burst_end:
            return not state.preferred
        if state.steps == burst_end:
            confirmed = better == state.preferred
            state.interval = min(2 * state.interval, MAX_EXPLORE_EVERY) if confirmed else EXPLORE_EVERY
            state.explore_at = state.steps + state.interval
            state.last_burst = state.steps
            state.burst_extension = 0
        state.steady = better and state.speculating
        state.speculating = better
        return better

    def observe(self, speculating: bool, num_requests: int, num_tokens: int, seconds: float) -> None:
        key = (speculating, self.bucket(num_requests))
        if speculating and key[1] in self.buckets:
            self._settle_switch(self.buckets[key[1]])
        totals = self.totals.setdefault(key, [0.0, 0.0])
        totals[0] = DECAY * totals[0] + num_tokens
        totals[1] = DECAY * totals[1] + seconds
        self.samples[key] = self.samples.get(key, 0) + 1


class Speculator:
    def __init__(self, proposer: Proposer | None, max_k: int, adaptive: bool, device: torch.device, draft_budget: int):
        self.proposer = proposer
        self.draft_budget = draft_budget  # tokens a step's first draft forward may read
        self.wants_drafts = False  # this step's plan gave some request k > 0: the draft reads
        # prompt chunks and the backlog of requests left behind alongside (within the budget)
        self.controller = SpecController(max_k, adaptive, free_drafts=proposer is not None and proposer.runner is None)
        self.modes = ModeChooser()
        self.device = device
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.catching_up = False  # this step's draft reads more than the last step's tokens
        self.catch_up_seconds = 0.0  # ... and what that costs beyond a usual first draft forward
        self.yield_correction = 0.0  # this step's expected minus realized verification yields
        self.proposed_per_position = [0] * max_k  # draft position i -> tokens proposed there
        self.accepted_per_position = [0] * max_k  # draft position i -> tokens accepted there

    @staticmethod
    def decode_only(batch: ScheduledBatch, lookahead: list[int]) -> bool:
        """Each request computes its last token plus its draft tokens, nothing else (no prompt)."""
        return all(n == 1 + k for n, k in zip(batch.num_scheduled_tokens, lookahead))

    def observe_forward(self, batch: ScheduledBatch, lookahead: list[int], started: float) -> None:
        """Time the target's forward of a decode-only step for the cost model. Prompt chunks stay
        out: their per-token cost (many rows per matmul) is not what a verification token costs."""
        if not self.decode_only(batch, lookahead):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.controller.target_cost.add(batch.total_tokens, time.perf_counter() - started)

    def _clock_draft_forward(self, index: int, num_tokens: int, num_requests: int, started: float) -> None:
        """Called after each draft forward (and its sampling) of a step. The first one catches up
        on every token the draft has not seen (the last step's accepted and bonus tokens, or a
        whole prompt), so its cost model is by tokens; the others compute one token per request."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        if index == 0:
            self.controller.draft_first_cost.add(num_tokens, seconds)
        else:
            self.controller.draft_cost.add(num_requests, seconds)

    def reserve(self, running: list[Request], max_model_len: int) -> None:
        """Choose k per decoding request and reserve room for its draft tokens."""
        self.catching_up, self.catch_up_seconds = False, 0.0
        for r in running:  # expected yields are this step's plan's
            r.spec.expected_yield = None
        self.yield_correction = 0.0
        if self.proposer is None:
            return
        candidates = [r for r in running if r.params.speculative and r.num_computed_tokens == r.num_tokens - 1]
        self.wants_drafts = False
        if not candidates or (self.controller.adaptive and not self.modes.speculate(len(running))):
            return
        budget = self.draft_budget
        ks = self.controller.plan(candidates)
        # the mode chooser counts a verification by its expected yield: one step's realized
        # yield (1 to k + 1 tokens per request) is too noisy to compare rates over a few steps
        expected = self.controller.expected if self.controller.adaptive else None
        for i, (r, k) in enumerate(zip(candidates, ks)):
            # never verify past max_tokens or the context
            k = min(k, r.params.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens)
            if k <= 0:
                continue
            self.wants_drafts = True
            if expected is not None:
                r.spec.expected_yield = expected[i]
            k = self.proposer.num_available(r, k)
            if self.proposer.runner is not None:
                behind = r.num_tokens - r.spec.num_computed_tokens
                if behind > budget:  # it catches up first (`propose` reads what budget is left)
                    continue
                budget -= behind
            r.spec.num_lookahead_tokens = k

    def propose(self, batch: ScheduledBatch, running: list[Request]) -> dict[str, torch.Tensor | None]:
        """Fit the reservations to what was scheduled, then propose. Returns the draft
        distributions by request id (None: one-hot on the drafts)."""
        if self.proposer is None:
            return {}
        to_draft, ks = [], []
        scheduled = set()
        for r, n in zip(batch.requests, batch.num_scheduled_tokens):
            scheduled.add(r.request_id)
            if not r.spec.num_lookahead_tokens:
                continue
            k = n - (r.num_tokens - r.num_computed_tokens)  # the budget may have cut it short
            r.spec.num_lookahead_tokens = max(k, 0)
            if k > 0:
                to_draft.append(r)
                ks.append(k)
        for r in running:  # reserved but not scheduled this step
            if r.spec.num_lookahead_tokens and r.request_id not in scheduled:
                r.spec.num_lookahead_tokens, r.spec.draft_token_ids = 0, []
        catch_up = []
        if self.proposer.runner is not None and self.wants_drafts:
            behind = sum(r.num_tokens - r.spec.num_computed_tokens for r in to_draft)
            catch_up = self._catch_up_rows(batch, self.draft_budget - behind)
            # a draft that sat out steps (or is new) first reads what it missed; when that dominates
            # the step, its cost beyond a usual first forward is estimated for the mode chooser
            behind += sum(end - r.spec.num_computed_tokens for r, end in catch_up)
            usual = sum(k + 1 for k in ks)
            self.catching_up = behind > 2 * usual
            first = self.controller.draft_first_cost
            if self.catching_up and first.ready:
                self.catch_up_seconds = max(first(behind) - first(usual), 0.0)
        if not to_draft and not catch_up:
            return {}
        probs = {}
        for r, proposal in zip(to_draft, self.proposer.propose(to_draft, ks, self._clock_draft_forward, catch_up)):
            r.spec.draft_token_ids = proposal.token_ids
            probs[r.request_id] = proposal.probs
        return probs

    @staticmethod
    def _catch_up_rows(batch: ScheduledBatch, budget: int) -> list[tuple[Request, int]]:
        """(request, end) for requests of this step that do not speculate and whose draft is behind
        what the target will have computed after it (a prompt chunk, or tokens missed while
        speculation was off): the draft reads up to `end`, at most `budget` tokens in all. The
        last known token is left for the forward that proposes from it."""
        rows = []
        for r, n in zip(batch.requests, batch.num_scheduled_tokens):
            if budget <= 0:
                break
            start = r.spec.num_computed_tokens
            end = min(r.num_computed_tokens + n, r.num_tokens - 1, start + budget)
            if r.spec.num_lookahead_tokens or not r.params.speculative or end <= start:
                continue
            rows.append((r, end))
            budget -= end - start
        return rows

    def observe_step(self, batch: ScheduledBatch, lookahead: list[int], num_new_tokens: int, seconds: float) -> None:
        """Feed a decode-only step (each request computes its last token plus its `lookahead`
        draft tokens, nothing else) to the mode chooser."""
        if self.proposer is None or not self.controller.adaptive:
            return
        if not self.decode_only(batch, lookahead):
            return
        if self.catching_up and not self.modes.steady(len(batch.requests)):
            # the drafts catch up on what they missed while speculation was off (or on whole
            # prompts, when speculation is new here): what switching it on costs, not its rate
            self.modes.charge_switch(len(batch.requests), self.catch_up_seconds)
            return
        # with speculation on, new requests' drafts reading their prompts are part of its rate
        self.modes.observe(any(lookahead), len(batch.requests), num_new_tokens + self.yield_correction, seconds)

    def record(self, request: Request, k: int, num_accepted: int) -> None:
        expected, request.spec.expected_yield = request.spec.expected_yield, None
        if expected is not None:
            self.yield_correction += expected[k] - (num_accepted + 1)
        self.controller.observe(request, k, num_accepted)
        self.num_draft_tokens += k
        self.num_accepted_tokens += num_accepted
        for i in range(k):
            self.proposed_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted
