"""Draft-model proposer: a small model with its own KV pool under the target's block tables.

The draft sees the same positions as the target, so a request's block table serves both pools.
`request.spec.num_computed_tokens` says how far the draft's KV is valid: a new or preempted
request starts at 0. The first draft forward of a step reads, for each request that speculates,
everything it has not seen (the last step's accepted and bonus tokens; more after sitting out),
and, without logits, the chunks other requests are behind by (a prompt alongside the target's
prefill chunk); then k - 1 single-token forwards follow. Each draws through the engine's sampler,
the draft tokens before it counted as output. After verification the draft's KV is valid up to
the target's num_computed_tokens at most.
"""
from __future__ import annotations

import time

import torch

from backend.model_runner import ModelRunner, StepInput
from backend.proposer import DraftClock, Proposal
from backend.request import Request
from backend.sampler import Sampler
from backend.sampling_metadata import build_sampling_metadata


class DraftProposer:
    def __init__(self, runner: ModelRunner, sampler: Sampler, vocab_size: int):
        self.runner = runner
        self.sampler = sampler  # the engine's: unseeded requests draw from its generator
        self.vocab_size = vocab_size

    def num_available(self, request: Request, k: int) -> int:
        return k

    def propose(self, requests: list[Request], ks: list[int], clock: DraftClock | None = None,
                catch_up: list[tuple[Request, int]] = ()) -> list[Proposal]:
        """k_r draft tokens per request and the draft distributions they were drawn from (None for
        a greedy request: its verification compares argmaxes and needs no distribution).
        `catch_up` (request, end) rows are only read, in the first forward: the draft's KV for
        their tokens up to `end` (a prompt chunk the target prefills this step, or what a request
        missed), no logits. clock(j, num_tokens, num_requests, start time) is called after the
        j-th forward and its sampling."""
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        for j in range(max(ks, default=1)):
            started = time.perf_counter()
            active = [i for i, k in enumerate(ks) if k > j]
            step = StepInput([], [], [], [])
            for i in active:
                r = requests[i]
                if j == 0:
                    start = min(r.spec.num_computed_tokens, r.num_tokens - 1)
                    step.add(r.tokens_slice(start, r.num_tokens), start, r.block_table, 1)
                else:
                    step.add([tokens[i][-1]], r.num_tokens - 1 + j, r.block_table, 1)
                r.spec.num_computed_tokens = step.start_positions[-1] + len(step.token_ids[-1])
            for r, end in catch_up if j == 0 else ():
                step.add(r.tokens_slice(r.spec.num_computed_tokens, end), r.spec.num_computed_tokens, r.block_table, 0)
                r.spec.num_computed_tokens = end
            logits = self.runner.run(step)
            if active:
                drafting = [requests[i] for i in active]
                meta = build_sampling_metadata(drafting, [[] for _ in active], self.vocab_size, self.sampler.generator,
                                               logits.device, prefixes=[tokens[i] for i in active])
                out = self.sampler(logits, meta)
                for row, (i, token) in enumerate(zip(active, out.token_ids[:, 0].tolist())):
                    tokens[i].append(token)
                    if not requests[i].params.greedy:  # a greedy verification compares argmaxes only
                        probs[i].append(out.probs[row])
            if clock is not None:
                clock(j, sum(len(t) for t in step.token_ids), len(active), started)
        return [Proposal(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]
