"""Adaptive speculation length: how many draft tokens each request gets this step.

With acceptance rate a (per draft token, each accepted independently) and k draft tokens, a step
yields on average
    E(k) = (1 - a^(k+1)) / (1 - a)
tokens. If a draft forward costs c target forwards and verifying k + 1 tokens costs what one
does (memory-bound decoding), the speedup is
    S(k) = (1 - a^(k+1)) / ((1 - a)(k c + 1)).
Measured acceptance is not independent (a draft that got one token right tends to get the next
right too), so the controller does not extrapolate from one rate: it measures survival,
s_i = P(the first i draft tokens are all accepted), and uses E(k) = 1 + s_1 + ... + s_k. Each
request has its own survival counts (recent verifications weigh more), shrunk toward the batch's
curve, so a new request starts from the batch's experience and one that sits out drifts back to
it and is tried again.
Under load a forward is no longer free in the number of tokens (on a CPU it never is), so the
controller measures, each as a line: the target's decode-only forwards (with draft tokens or
without) in their tokens, T(n); the draft's first forward of a step (which catches up on what the
last step accepted, about E_r tokens per request) in its tokens; each further draft forward in the
requests. It picks the k that maximises tokens per second for the whole batch,
    sum_r E_r(k_r) / (T(sum_r (1 + k_r)) + T_draft_first(sum_r E_r) + (k - 1) T_draft(R)),
against R / T(R) without drafts, each request's k_r capped where its own
E_r(k) / (1 + T_draft(k) / T(R)) stops improving. k = 0 when nothing pays: then no draft work
is done at all, so speculation never makes a server slower.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from backend.core.request import Request
from backend.core.spec_state import Survival

ACCEPTANCE_PRIOR = 0.7  # survival s_i = 0.7^i before anything is measured ...
PRIOR_COUNT = 2.0  # ... worth this many verifications
SHRINK_COUNT = 4.0  # a request's curve counts the batch's as this many of its own verifications
REQUEST_DECAY = 0.95  # per verification (or step sat out), weight kept by a request's older counts
EXPLORE_K_EVERY = 8  # every this many plans, speculating requests draft one token more than planned
PROBE_REQUESTS = 4  # requests that speculate while the step costs are still unmeasured
BATCH_DECAY = 0.99  # per verification, weight kept by the batch's older counts


class LinearCost:
    """Seconds per forward as t0 + t1 * num_tokens: a least-squares line over the latest
    `per_size` samples of each size, kept as running sums so that adding a sample costs O(1).
    Samples are kept per size so that a long run at one size (plain decoding: one token per
    request, step after step) does not push out what was measured at the others: with them
    the slope would go, and verification tokens would look free."""

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
        return self.t0 + self.t1 * num_tokens


class SpecController:
    def __init__(self, max_k: int, adaptive: bool = True, free_drafts: bool = False):
        self.max_k = max_k
        self.adaptive = adaptive
        self.free_drafts = free_drafts  # a proposer without a model (n-gram lookup): no draft cost
        self.target_cost = LinearCost()  # a decode-only target forward (drafts or not), by tokens
        self.draft_first_cost = LinearCost()  # a step's first draft forward (catch-up), by tokens
        self.draft_cost = LinearCost()  # each further draft forward, by requests
        self.batch_survival = Survival(max_k)
        self.num_plans = 0
        self.expected: np.ndarray | None = None  # the latest adaptive plan's E(0..max_k) per request

    def expected_tokens_batch(self, requests: list[Request]) -> np.ndarray:
        """[len(requests), max_k + 1]: each request's E(0..max_k), its own survival counts shrunk
        toward the batch's curve (a request with no counts has the batch's curve)."""
        batch = self.batch_survival.curve(PRIOR_COUNT, ACCEPTANCE_PRIOR)
        reached = np.zeros((len(requests), self.max_k))
        survived = np.zeros((len(requests), self.max_k))
        for i, r in enumerate(requests):
            own = r.spec.survival
            if own is not None:
                reached[i], survived[i] = own.reached, own.survived
        curves = np.minimum.accumulate((survived + SHRINK_COUNT * batch) / (reached + SHRINK_COUNT), axis=1)
        return np.concatenate((np.ones((len(requests), 1)), 1.0 + np.cumsum(curves, axis=1)), axis=1)

    def plan(self, requests: list[Request]) -> list[int]:
        """k per request (same order); 0 means this request does not speculate this step."""
        if not requests or self.max_k == 0:
            return [0] * len(requests)
        if not self.adaptive:
            return [self.max_k] * len(requests)
        expected = self.expected = self.expected_tokens_batch(requests)  # [num, max_k + 1]
        costs = (self.target_cost,) if self.free_drafts else (self.target_cost, self.draft_first_cost, self.draft_cost)
        if not all(cost.ready for cost in costs):
            # cheap probes until the costs are measured: a few requests, a short draft (the first
            # draft forward of a request also reads its whole prompt)
            probes = min(PROBE_REQUESTS, len(requests))
            return [min(2, self.max_k)] * probes + [0] * (len(requests) - probes)
        num = len(requests)
        plain_seconds = self.target_cost(num)  # a step without drafts
        # the first draft forward catches up on what the last step accepted: about E(k) tokens each
        catch_up = float(expected[:, -1].sum())
        # the draft's seconds for k = 0..max_k, relative to a target forward
        draft_seconds = np.array([self.draft_seconds(num, k, catch_up) for k in range(self.max_k + 1)])
        caps = np.argmax(expected / (1 + draft_seconds / max(plain_seconds, 1e-9)), axis=1)
        for r, cap in zip(requests, caps):
            own = r.spec.survival
            if cap == 0 and own is not None:  # sitting out, it measures nothing: fade its counts
                own.add(0, 0, REQUEST_DECAY)
        best_ks, best_rate = np.zeros(num, dtype=int), num / max(plain_seconds, 1e-9)
        rows = np.arange(num)
        for k in range(1, self.max_k + 1):
            ks = np.minimum(k, caps)
            seconds = self.target_cost(num + int(ks.sum())) + draft_seconds[ks.max()]
            rate = expected[rows, ks].sum() / max(seconds, 1e-9)
            if rate > best_rate:
                best_ks, best_rate = ks, rate
        self.num_plans += 1
        if self.num_plans % EXPLORE_K_EVERY == 0:  # one more draft token now and then: a position
            # never drafted is never measured, and its estimate would keep it from being drafted
            best_ks = np.where(best_ks > 0, np.minimum(best_ks + 1, self.max_k), 0)
        return [int(k) for k in best_ks]

    def draft_seconds(self, num_requests: int, k: int, catch_up_tokens: float) -> float:
        if k == 0 or self.free_drafts:
            return 0.0
        return self.draft_first_cost(catch_up_tokens) + (k - 1) * self.draft_cost(num_requests)

    def observe(self, request: Request, num_draft: int, num_accepted: int) -> None:
        """Count a verification: num_draft tokens drafted, the first num_accepted kept."""
        if not num_draft:
            return
        self.batch_survival.add(num_draft, num_accepted, BATCH_DECAY)
        own = request.spec.survival = request.spec.survival or Survival(self.max_k)
        own.add(num_draft, num_accepted, REQUEST_DECAY)
        request.spec.num_draft_tokens += num_draft
        request.spec.num_accepted_tokens += num_accepted
