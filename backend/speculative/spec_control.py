"""Speculation control: whether speculation pays at this batch size, and how many draft tokens
each request gets.

    ks = control.plan(candidates, num_running)   # before a step is scheduled
    control.observe_*(what the step measured)    # once its tokens are back

Two measured parts decide.

k per request (`SpecControl.plan`). With acceptance rate a (per draft token, each accepted
independently) and k draft tokens, a step yields on average E(k) = (1 - a^(k+1)) / (1 - a) tokens;
if a draft forward costs c target forwards and verifying k + 1 tokens costs what one does
(memory-bound decoding), the speedup is S(k) = (1 - a^(k+1)) / ((1 - a)(k c + 1)). Measured
acceptance is not independent (a draft that got one token right tends to get the next right too),
so the control does not extrapolate from one rate: it counts survival, s_i = P(the first i draft
tokens are all accepted), and uses E(k) = 1 + s_1 + ... + s_k. Each request has its own counts
(recent verifications weigh more), shrunk toward the batch's curve, so a new request starts from
the batch's experience and one that sits out drifts back to it and is tried again. A forward is
not free in its tokens under load (on a CPU it never is), so the costs are measured too, each as a
line: the target's decode-only forwards in their tokens, T(n); the draft's first forward of a step
(which catches up on what the last step accepted, about E_r tokens per request) in its tokens;
each further draft forward in the requests. The plan maximises the batch's tokens per second,
    sum_r E_r(k_r) / (T(sum_r (1 + k_r)) + T_draft_first(sum_r E_r) + (k - 1) T_draft(R)),
against R / T(R) without drafts, each k_r capped where its own predicted speedup
E_r(k) / (1 + (T_draft(k) + T(R + k) - T(R)) / T(R)) stops rising. T is measured on the forwards
that run: at R tokens a compiled decode step where decode is compiled, at R + k an eager or compiled
verification, so what compiling buys plain decoding counts against speculation. k = 0 when
nothing pays: then no draft work is done at all. While nothing is verified the batch's counts fade
toward the prior, as a request's do while it sits out.

Speculation on or off (`ModeChooser`, mode_chooser.py): per batch-size bucket, the measured tokens
per second of decode-only steps with and without speculation, the faster kept. While the chooser
tries speculation (at first, and in its bounded exploration bursts) every candidate drafts at least
one token, so a method that stood aside is measured again, acceptance included, and comes back
when it pays.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Container

import numpy as np

from backend.core.request import Request
from backend.speculative.mode_chooser import ModeChooser

ACCEPTANCE_PRIOR = 0.7  # survival s_i = 0.7^i before anything is measured ...
PRIOR_WEIGHT = 4.0  # ... worth this many verifications; a request's curve counts the batch's as many
REQUEST_MEMORY = 20  # verifications a request's counts remember (each keeps 1 - 1/20 of the older ones)
BATCH_MEMORY = 100  # verifications the batch's counts remember
PROBE_REQUESTS = 4  # requests that speculate while the step costs are still unmeasured


class LinearCost:
    """Seconds per forward: at a size measured at least twice, the median of its latest samples
    (a forward that met a new shape or another tenant's burst does not price its size for good);
    elsewhere t0 + t1 * num_tokens, a least-squares line over the latest `per_size` samples of
    each size, kept as running sums so that adding a sample costs O(1). Samples are kept per size
    so that a long run at one size (plain decoding: one token per request, step after step) does
    not push out what was measured at the others: with them the slope would go, and verification
    tokens would look free. A measured size is taken as measured because a forward's cost is not
    a line: on a CPU a float32 matmul of 4 rows costs twice one of 3 (another kernel)."""

    def __init__(self, per_size: int = 16):
        self.samples: dict[int, deque[float]] = {}  # num_tokens -> latest seconds
        self.per_size = per_size
        self.sums = [0.0] * 5  # count, sum n, sum t, sum n^2, sum n t
        self.t0, self.t1 = 0.0, 0.0

    def _accumulate(self, n: float, t: float, sign: float) -> None:
        for i, value in enumerate((1.0, n, t, n * n, n * t)):
            self.sums[i] += sign * value

    def add(self, num_tokens: int, seconds: float) -> None:
        latest = self.samples.setdefault(num_tokens, deque())
        latest.append(seconds)
        self._accumulate(num_tokens, seconds, 1.0)
        if len(latest) > self.per_size:
            self._accumulate(num_tokens, latest.popleft(), -1.0)
        count, sn, st, snn, snt = self.sums
        spread = count * snn - sn * sn  # count^2 * variance of n: 0 when every n is the same
        if spread > 1e-9 * max(count * snn, 1.0):
            t1 = (count * snt - sn * st) / spread
            self.t0, self.t1 = max((st - t1 * sn) / count, 0.0), max(t1, 0.0)
        else:
            self.t0, self.t1 = st / count, 0.0

    @property
    def ready(self) -> bool:
        return self.sums[0] >= 2

    def __call__(self, num_tokens: int) -> float:
        latest = self.samples.get(num_tokens)
        if latest is not None and len(latest) >= 2:
            return statistics.median(latest)
        return self.t0 + self.t1 * num_tokens


class Survival:
    """Decayed counts, per draft position i: verifications that drafted it, and how many of
    those accepted every token up to and including it."""

    def __init__(self, max_k: int, memory: int):
        self.reached = np.zeros(max_k)
        self.survived = np.zeros(max_k)
        self.decay = 1.0 - 1.0 / memory

    def add(self, num_draft: int, num_accepted: int) -> None:
        self.reached *= self.decay
        self.survived *= self.decay
        self.reached[:num_draft] += 1
        self.survived[:num_accepted] += 1

    def curve(self) -> np.ndarray:
        """s_1..s_max_k: the counts shrunk toward the prior, never rising with i. Position 1's
        prior is ACCEPTANCE_PRIOR and each later position's continues the previous conditional
        rate s_i / s_(i-1): a position rarely drafted is judged by the ones before it, not by a
        constant that would keep it from ever being drafted."""
        s = np.empty_like(self.reached)
        previous, conditional = 1.0, ACCEPTANCE_PRIOR
        for i in range(len(s)):
            guess = previous * conditional
            s[i] = min((self.survived[i] + PRIOR_WEIGHT * guess) / (self.reached[i] + PRIOR_WEIGHT), previous)
            conditional = s[i] / previous if previous > 0 else 0.0
            previous = s[i]
        return s


class SpecControl:
    def __init__(self, max_k: int, adaptive: bool = True, free_drafts: bool = False):
        self.max_k = max_k
        self.adaptive = adaptive
        self.free_drafts = free_drafts  # a proposer without a model (n-gram lookup): no draft cost
        self.target_cost = LinearCost()  # a decode-only target forward (drafts or not), by tokens
        self.draft_first_cost = LinearCost()  # a step's first draft forward (catch-up), by tokens
        self.draft_cost = LinearCost()  # each further draft forward, by requests
        self.batch_survival = Survival(max_k, BATCH_MEMORY)
        self.survival: dict[str, Survival] = {}  # request id -> its own counts, once it has verified
        self.modes = ModeChooser()
        self.probing = False  # the last plan drafts in a burst that measures speculation (its tokens count as they came)

    # -- before a step ----------------------------------------------------------------------------
    def plan(self, candidates: list[Request], num_running: int) -> tuple[list[int], np.ndarray | None]:
        """(k per candidate, in order: 0 = it does not speculate; each candidate's expected yields
        E(0..max_k) when k adapts, else None). `candidates` are the decoding requests,
        `num_running` the batch the step decodes."""
        if not candidates or self.max_k == 0:
            return [0] * len(candidates), None
        if not self.adaptive:
            return [self.max_k] * len(candidates), None
        self.probing = False
        if not self.modes.speculate(num_running):
            self.batch_survival.add(0, 0)  # nothing verified: what was measured grows stale, the prior returns
            return [0] * len(candidates), None
        ids = [r.request_id for r in candidates]
        self.probing = self.modes.trying(num_running)
        ks, expected = self.choose_k(ids, probe=self.probing)
        if not any(ks):
            # measured faster with speculation, predicted not (its counts are stale): the measurement
            # wins, and the verifications bring the counts up to date
            ks, expected = self.choose_k(ids, probe=True)
        return ks, expected

    def choose_k(self, ids: list[str], probe: bool = False) -> tuple[list[int], np.ndarray]:
        """k per request, from their expected yields (returned too) and the measured costs. A
        request's k is capped where its own predicted speedup, its yield over what its drafts and
        its verified tokens add to a plain step, stops rising (0: below 1, it sits out); the batch's
        k is the one of most tokens per second, 0 where plain steps are faster. `probe`: the step
        measures speculation, so every request drafts (k >= 1) whatever the prediction says."""
        expected = self.expected_yields(ids)  # [num, max_k + 1]
        costs = (self.target_cost,) if self.free_drafts else (self.target_cost, self.draft_first_cost, self.draft_cost)
        if not all(cost.ready for cost in costs):
            # cheap probes until the costs are measured: a few requests, a short draft (the first
            # draft forward of a request also reads its whole prompt)
            probes = min(PROBE_REQUESTS, len(ids))
            return [min(2, self.max_k)] * probes + [0] * (len(ids) - probes), expected
        num = len(ids)
        plain_seconds = max(self.target_cost(num), 1e-9)  # a step without drafts, as it runs (compiled or not)
        # the first draft forward catches up on what the last step accepted: about E(k) tokens each
        catch_up = float(expected[:, -1].sum())
        # the draft's seconds for k = 0..max_k, and what verifying k more tokens adds to the target's step
        draft_seconds = np.array([self.draft_seconds(num, k, catch_up) for k in range(self.max_k + 1)])
        verify_seconds = np.array([max(self.target_cost(num + k) - plain_seconds, 0.0) for k in range(self.max_k + 1)])
        caps = np.argmax(expected / (1 + (draft_seconds + verify_seconds) / plain_seconds), axis=1)
        for rid, cap in zip(ids, caps):
            if cap == 0 and rid in self.survival:  # sitting out, it measures nothing: fade its counts
                self.survival[rid].add(0, 0)
        if probe:
            caps = np.maximum(caps, 1)
        best_ks, best_rate = np.zeros(num, dtype=int), -1.0 if probe else num / plain_seconds
        rows = np.arange(num)
        for k in range(1, self.max_k + 1):
            ks = np.minimum(k, caps)
            seconds = self.target_cost(num + int(ks.sum())) + draft_seconds[ks.max()]
            rate = expected[rows, ks].sum() / max(seconds, 1e-9)
            if rate > best_rate:
                best_ks, best_rate = ks, rate
        return [int(k) for k in best_ks], expected

    def expected_yields(self, request_ids: list[str]) -> np.ndarray:
        """[len(request_ids), max_k + 1]: each request's E(0..max_k), its own survival counts
        shrunk toward the batch's curve (a request with no counts has the batch's curve)."""
        batch = self.batch_survival.curve()
        reached = np.zeros((len(request_ids), self.max_k))
        survived = np.zeros((len(request_ids), self.max_k))
        for i, rid in enumerate(request_ids):
            own = self.survival.get(rid)
            if own is not None:
                reached[i], survived[i] = own.reached, own.survived
        curves = np.minimum.accumulate((survived + PRIOR_WEIGHT * batch) / (reached + PRIOR_WEIGHT), axis=1)
        return np.concatenate((np.ones((len(request_ids), 1)), 1.0 + np.cumsum(curves, axis=1)), axis=1)

    def draft_seconds(self, num_requests: int, k: int, catch_up_tokens: float) -> float:
        if k == 0 or self.free_drafts:
            return 0.0
        return self.draft_first_cost(catch_up_tokens) + (k - 1) * self.draft_cost(num_requests)

    def catch_up_seconds(self, behind: int, usual: int) -> float | None:
        """A step's first draft forward reads `behind` tokens where `usual` would do: when that is
        far more (drafts catching up on what they missed), what it costs beyond a usual first
        forward (0 while that cost is unmeasured); None when it is not a catch-up."""
        if behind <= 2 * usual:
            return None
        first = self.draft_first_cost
        return max(first(behind) - first(usual), 0.0) if first.ready else 0.0

    def forget_all_but(self, live: Container[str]) -> None:
        """Drop the counts of requests that are gone."""
        for rid in [rid for rid in self.survival if rid not in live]:
            del self.survival[rid]

    # -- after a step's read-back -----------------------------------------------------------------
    def observe_verification(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """Count a verification: num_draft tokens drafted, the first num_accepted kept."""
        if not num_draft:
            return
        self.batch_survival.add(num_draft, num_accepted)
        own = self.survival.get(request_id)
        if own is None:
            own = self.survival[request_id] = Survival(self.max_k, REQUEST_MEMORY)
        own.add(num_draft, num_accepted)

    def observe_target_forward(self, num_tokens: int, seconds: float) -> None:
        """A decode-only target forward (prompt chunks cost per token what verification does not)."""
        self.target_cost.add(num_tokens, seconds)

    def observe_draft_forward(self, index: int, num_tokens: int, num_requests: int, seconds: float) -> None:
        """The first draft forward of a step catches up on every token the draft has not seen, so
        it is costed by tokens; the others compute one token per request."""
        if index == 0:
            self.draft_first_cost.add(num_tokens, seconds)
        else:
            self.draft_cost.add(num_requests, seconds)

    def observe_step(self, speculating: bool, num_requests: int, num_tokens: float, seconds: float,
                     catch_up_seconds: float | None = None) -> None:
        """A decode-only step: each request computed its last token and its drafts, nothing else.
        `num_tokens` counts each verification by its expected yield; `catch_up_seconds`: what the
        step's plan measured (`catch_up_seconds`, None: no catch-up)."""
        if not self.adaptive:
            return
        if catch_up_seconds is not None and not self.modes.steady(num_requests):
            # the drafts catch up on what they missed while speculation was off (or on whole
            # prompts, when speculation is new here): what switching it on costs, not its rate
            self.modes.charge_switch(num_requests, catch_up_seconds)
            return
        # with speculation on, new requests' drafts reading their prompts are part of its rate
        self.modes.observe(speculating, num_requests, num_tokens, seconds)
