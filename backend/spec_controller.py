"""Adaptive speculation length: how many draft tokens each request gets this step.

With acceptance rate a (per draft token) and k draft tokens, a step yields on average
    E(k) = (1 - a^(k+1)) / (1 - a)
tokens. If a draft forward costs c target forwards and verifying k + 1 tokens costs what one
does (memory-bound decoding), the speedup is
    S(k) = (1 - a^(k+1)) / ((1 - a)(k c + 1)).
Under load a forward is no longer free in the number of tokens (on a CPU it never is), so the
controller measures both models' step times as a line in the number of tokens, T(n) = t0 + t1 n,
and picks the k that maximises tokens per second for the whole batch:
    sum_r E_r(k_r) / (T_target(sum_r (1 + k_r)) + k T_draft(R)),
with each request's k_r capped where its own S(k) stops improving. k = 0 when nothing pays:
then no draft work is done at all, so speculation never makes a loaded server slower.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from backend.request import Request

EMA = 0.2  # weight of the newest step in a request's acceptance rate
A_MAX = 0.98  # acceptance is clipped below 1 so E(k) stays finite and k stays bounded


class LinearCost:
    """Seconds per forward as t0 + t1 * num_tokens, fitted over the latest samples."""

    def __init__(self, window: int = 200):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.t0, self.t1 = 0.0, 0.0

    def add(self, num_tokens: int, seconds: float) -> None:
        self.samples.append((num_tokens, seconds))
        n = np.array([s[0] for s in self.samples], dtype=float)
        t = np.array([s[1] for s in self.samples], dtype=float)
        if len(set(n.tolist())) >= 2:
            t1, t0 = np.polyfit(n, t, 1)
            self.t0, self.t1 = max(float(t0), 0.0), max(float(t1), 0.0)
        else:
            self.t0, self.t1 = float(t.mean()), 0.0

    @property
    def ready(self) -> bool:
        return len(self.samples) >= 2

    def __call__(self, num_tokens: int) -> float:
        return self.t0 + self.t1 * num_tokens


def expected_tokens(a: float, k: int) -> float:
    a = min(max(a, 0.0), A_MAX)
    return (1 - a ** (k + 1)) / (1 - a)


def speedup(a: float, k: int, c: float) -> float:
    return expected_tokens(a, k) / (k * c + 1)


class SpecController:
    def __init__(self, max_k: int, adaptive: bool = True):
        self.max_k = max_k
        self.adaptive = adaptive
        self.target_cost = LinearCost()
        self.draft_cost = LinearCost()

    def plan(self, requests: list[Request]) -> list[int]:
        """k per request (same order); 0 means this request does not speculate this step."""
        if not requests or self.max_k == 0:
            return [0] * len(requests)
        if not self.adaptive or not (self.target_cost.ready and self.draft_cost.ready):
            return [self.max_k] * len(requests)
        num = len(requests)
        c = self.draft_cost(num) / max(self.target_cost(num), 1e-9)
        caps = [self._own_best_k(r.acceptance_rate, c) for r in requests]
        best_ks, best_rate = [0] * num, num / max(self.target_cost(num), 1e-9)
        for k in range(1, self.max_k + 1):
            ks = [min(k, cap) for cap in caps]
            tokens = sum(expected_tokens(r.acceptance_rate, kr) for r, kr in zip(requests, ks))
            seconds = self.target_cost(num + sum(ks)) + max(ks) * self.draft_cost(num)
            rate = tokens / max(seconds, 1e-9)
            if rate > best_rate:
                best_ks, best_rate = ks, rate
        return best_ks

    def _own_best_k(self, a: float, c: float) -> int:
        scores = [speedup(a, k, c) for k in range(self.max_k + 1)]
        return int(np.argmax(scores))

    @staticmethod
    def observe(request: Request, num_draft: int, num_accepted: int) -> None:
        """Update the request's acceptance rate after a verification. The walk stops at the first
        rejection, so a step is n successes and (n < k) failures of a per-token coin."""
        if num_draft:
            trials = num_accepted + (1 if num_accepted < num_draft else 0)
            request.acceptance_rate = (1 - EMA) * request.acceptance_rate + EMA * num_accepted / trials
            request.num_draft_tokens += num_draft
            request.num_accepted_tokens += num_accepted
