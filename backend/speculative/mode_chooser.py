"""Speculation on or off, per batch-size bucket, from measured decode-only steps' tokens per second.

The S(k) model of spec_control.py leaves costs out (verification bookkeeping, the drafts' catch-up,
a compiled decode step against an eager or compiled verification), so per batch-size bucket the
control also measures decode-only steps' tokens per second in both modes and keeps the faster,
trying the other again now and then, in bursts whose cost (their slower steps, the drafts'
catch-up) is kept to EXPLORE_LOSS of the time. A mode's rate forgets with the bucket's steps,
measured or not, so a burst measures the mode as it is now. In steady speculation a verification
counts by its expected yield E(k), not the 1..k+1 tokens it happened to yield (too noisy over a few
steps); in a probe (a burst, or speculation measured faster where the counts predicted otherwise)
by what it yielded, since the counts it would be expected from are stale. Steps whose drafts catch
up on what they missed while speculation was off are charged to switching it on, not to its rate.
"""
from __future__ import annotations

from dataclasses import dataclass

MODE_MEMORY = 10  # decode-only steps a mode's measured rate remembers
MEASURE_STEPS = 4  # steps a mode is measured in a row: at first (alternating) and in each burst
EXPLORE_EVERY = 32  # steps before the mode that looks worse is tried again; each burst that
# confirms the choice doubles the wait, until bursts take EXPLORE_BUDGET of the steps
EXPLORE_BUDGET = 1 / 32
MAX_EXPLORE_EVERY = round(MEASURE_STEPS / EXPLORE_BUDGET)  # 128
EXPLORE_LOSS = 1 / 64  # and, whatever the step count, trying the slower mode (its slower steps, the
# drafts' catch-up) costs at most this share of the time: a speculative step dearer than two plain
# ones (compiled decode against an eager verification) waits longer before it is tried again


@dataclass(slots=True)
class _Bucket:
    steps: int = 0  # decisions made for this batch-size bucket
    explore_at: int = EXPLORE_EVERY  # step at which the next exploration burst starts
    interval: int = EXPLORE_EVERY
    preferred: bool = True  # the choice when the current burst started
    speculating: bool = False  # the last choice outside bursts
    steady: bool = False  # this step speculates, as the one before did (no switch, no burst)
    trying: bool = False  # this step speculates to measure it (at first, or in a burst), not by choice
    last_burst: int = 0  # step at which the last exploration burst ended
    burst_extension: int = 0  # steps the current burst spent catching up, added to its length
    switch_seconds: float = 0.0  # measured cost of switching speculation on (the drafts' catch-up) ...
    switch_accrued: float = 0.0  # ... and of the switch under way, which may take several steps

    @property
    def switch_cost(self) -> float:
        return max(self.switch_seconds, self.switch_accrued)

    def in_burst(self) -> bool:
        return self.explore_at <= self.steps < self.explore_at + MEASURE_STEPS + self.burst_extension


class ModeChooser:
    """Measures what speculation actually buys: decode-only steps' output tokens per second with
    speculation and without, per batch-size bucket, and picks the faster mode. The other mode is
    tried again in bursts of MEASURE_STEPS steps; a burst that confirms the choice doubles the
    wait before the next (a settled choice costs little exploration), one that overturns it
    resets the wait. It catches every cost the S(k) model leaves out (verification bookkeeping,
    draft catch-up), so a loaded server does not get slower. A rate is decayed tokens over
    decayed seconds (not an average of per-step rates, which a speculative step's 1-or-k+1
    tokens would bias)."""

    def __init__(self) -> None:
        self.totals: dict[tuple[bool, int], list[float]] = {}  # (speculating, bucket) -> [tokens, seconds, steps]
        self.samples: dict[tuple[bool, int], int] = {}  # (speculating, bucket) -> steps measured
        self.observed_at: dict[tuple[bool, int], int] = {}  # (speculating, bucket) -> the bucket's step then
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(num_requests: int) -> int:
        return max(num_requests, 1).bit_length()  # 1, 2-3, 4-7, ...

    def rate(self, speculating: bool, num_requests: int) -> float | None:
        """Measured tokens/s of a mode at this batch size; None before any measurement."""
        key = (speculating, self.bucket(num_requests))
        return self._rate(key) if key in self.totals else None

    def _rate(self, key: tuple[bool, int]) -> float:
        tokens, seconds, _ = self.totals[key]
        return tokens / max(seconds, 1e-9)

    def _warm(self, b: int) -> bool:
        return min(self.samples.get((True, b), 0), self.samples.get((False, b), 0)) >= MEASURE_STEPS

    def _faster(self, b: int, num_requests: int) -> bool | None:
        """Is speculation faster in bucket b? Judged by the bucket itself once both modes are
        measured there, meanwhile by a measured neighbour (batch sizes change as requests come
        and go); None when neither can tell. Switching speculation on costs the drafts' catch-up
        on what they missed, so from plain decoding it must win by enough to earn that back
        before the next exploration burst (a tie goes to plain decoding)."""
        state, measured = self.buckets[b], self._measured(b)
        if measured is None:
            return None
        on, off = self._rate((True, measured)), self._rate((False, measured))
        if state.speculating:
            return on > off
        step_seconds = num_requests / max(off, 1e-9)  # a plain step yields a token per request
        return on > off * (1 + state.switch_cost / (state.interval * step_seconds))

    def _measured(self, b: int) -> int | None:
        """The bucket that judges bucket b: itself once both modes are measured there, else a
        measured neighbour; None when neither is."""
        return next((candidate for candidate in (b, b - 1, b + 1) if self._warm(candidate)), None)

    def _explore_gap(self, b: int, better: bool) -> int:
        """Steps from the last burst to the next such that trying the slower mode costs at most
        EXPLORE_LOSS of the time: a burst's steps, each longer than the faster mode would take for
        its tokens, and, when speculation is the one tried, the drafts' catch-up."""
        measured = self._measured(b)
        kept_tokens, kept_seconds, kept_steps = self.totals[(better, measured)]
        tried_tokens, tried_seconds, tried_steps = self.totals[(not better, measured)]
        kept_rate = kept_tokens / max(kept_seconds, 1e-9)
        lost = MEASURE_STEPS * max(tried_seconds - tried_tokens / kept_rate, 0.0) / tried_steps
        if not better:
            lost += self.buckets[b].switch_cost
        return int(lost / (EXPLORE_LOSS * kept_seconds / kept_steps))

    def trying(self, num_requests: int) -> bool:
        """The latest choice at this batch size speculates to measure speculation, not because it
        measured faster: every candidate should draft, or the burst measures nothing."""
        state = self.buckets.get(self.bucket(num_requests))
        return state is not None and state.trying

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
        state.steady = state.trying = False
        if better is None:  # nothing measured here or nearby: measure both, alternating
            n_on, n_off = self.samples.get((True, b), 0), self.samples.get((False, b), 0)
            state.trying = n_on < n_off or (n_on == n_off and state.steps % 2 == 1)
            return state.trying
        if state.steps == state.explore_at:  # a burst is due, unless what it would lose asks for a longer wait
            state.explore_at = max(state.explore_at, state.last_burst + self._explore_gap(b, better))
        burst_end = state.explore_at + MEASURE_STEPS + state.burst_extension
        if state.steps == state.explore_at:
            state.preferred = better
        if state.explore_at <= state.steps < burst_end:
            state.trying = not state.preferred
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

    def observe(self, speculating: bool, num_requests: int, num_tokens: float, seconds: float) -> None:
        key = (speculating, self.bucket(num_requests))
        if speculating and key[1] in self.buckets:
            self._settle_switch(self.buckets[key[1]])
        # a mode's rate forgets with the bucket's steps, measured or not: a burst after a long wait
        # measures the mode as it is now, not as it was when last chosen
        state = self.buckets.get(key[1])
        now = state.steps if state is not None else self.observed_at.get(key, 0) + 1
        decay = (1.0 - 1.0 / MODE_MEMORY) ** max(now - self.observed_at.get(key, now - 1), 1)
        self.observed_at[key] = now
        totals = self.totals.setdefault(key, [0.0, 0.0, 0.0])
        totals[0] = decay * totals[0] + num_tokens
        totals[1] = decay * totals[1] + seconds
        totals[2] = decay * totals[2] + 1
        self.samples[key] = self.samples.get(key, 0) + 1
