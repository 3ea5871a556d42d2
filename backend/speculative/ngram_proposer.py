"""Prompt-lookup (n-gram) proposer: no draft model.

If the last n tokens (n from `max_ngram` down to `min_ngram`) occurred earlier in the prompt or
output, propose the k tokens that followed their most recent earlier occurrence. Code, quotes and
edits repeat themselves, so this is often right and costs almost nothing. Its proposal is
deterministic: a one-hot draft distribution for the rejection sampler.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from backend.core.request import Request
from backend.core.spec_state import Proposal
from backend.model.step_inputs import PendingTokens
from backend.step_timer import StepTimer


class NgramProposer:
    runner = None  # a lookup: no forward, nothing to catch up on

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4):
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def num_available(self, request: Request, k: int) -> int:
        if request.num_pending_tokens:  # its last tokens are still on the device (overlapped steps)
            return 0
        return len(self.lookup(request.all_token_ids, k))

    def propose(self, requests: list[Request], ks: list[int], timer: StepTimer | None = None,
                catch_up: list[tuple[Request, int]] = (), pending: PendingTokens | None = None) -> list[Proposal]:
        return [Proposal(self.lookup(r.all_token_ids, k), None) for r, k in zip(requests, ks)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens < 2:
            return []
        ids = np.asarray(token_ids)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            windows = sliding_window_view(ids[:-1], n)  # every earlier n-gram, by start
            starts = np.flatnonzero((windows == ids[n_tokens - n :]).all(axis=1))
            if len(starts):
                start = int(starts[-1])  # most recent earlier occurrence
                return token_ids[start + n : start + n + k]
        return []
