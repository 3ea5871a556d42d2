"""Whether speculation pays at a batch size: measured tokens per second with it and without.

The S(k) model (spec_controller.py) leaves costs out (verification bookkeeping, the drafts'
catch-up), so the policy does not trust it alone: per batch-size bucket it measures decode-only
steps in both modes and keeps the faster, trying the other again now and then.
"""
from __future__ import annotations

from dataclasses import dataclass

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
