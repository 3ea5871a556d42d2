"""Draft-model proposer: a small model with its own KV pool under the target's block tables.

The draft sees the same positions as the target, so a request's block table serves both pools.
`request.spec.num_computed_tokens` says how far the draft's KV is valid: a new or preempted
request starts at 0. The first draft forward of a step reads, for each request that speculates,
everything it has not seen (the last step's accepted and bonus tokens; more after sitting out),
and, without logits, the chunks other requests are behind by (a prompt alongside the target's
prefill chunk); then k - 1 single-token forwards follow, each fed the token the one before drew,
on the device. Each draws through the engine's sampler (penalties see the request's known output,
not the drafts of the step). With overlapped steps, a request whose last step is still on the
device reads that step's tokens from there (step_inputs.draft_first_input).
After verification the draft's KV is valid up to the target's num_computed_tokens at most.
"""
from __future__ import annotations

import torch

from backend.core.request import Request
from backend.core.spec_state import Proposal
from backend.host_copy import HostCopy
from backend.model.model_runner import ModelRunner, StepInput
from backend.model.step_inputs import PendingTokens, draft_first_input
from backend.sample.sampler import Sampler
from backend.sample.sampling_metadata import build_sampling_metadata
from backend.step_timer import StepTimer


class Drafts:
    """A step's drafts for the whole batch, one tensor each, written once per forward: tokens
    [requests, max k] and, where some request's verification reads them (sampled without a seed),
    the distributions they were drawn from [requests, max k, vocab]. A request's proposal is a view
    of its row; one copy brings every token to the host."""

    def __init__(self, requests: list[Request], ks: list[int], device: torch.device):
        self.requests, self.ks = requests, ks
        self.tokens = torch.zeros((len(requests), max(ks, default=0)), dtype=torch.long, device=device)
        # verification compares tokens only for greedy and seeded requests: no distribution kept
        self.reads_probs = [not r.params.greedy and r.params.seed is None for r in requests]
        self.probs: torch.Tensor | None = None

    def put(self, j: int, active: list[int], tokens: torch.Tensor, probs: torch.Tensor | None) -> None:
        """Draft j of requests[i] for i in `active` (rows in that order)."""
        rows = slice(None) if len(active) == len(self.requests) else torch.tensor(active, device=self.tokens.device)
        self.tokens[rows, j] = tokens
        if probs is not None and any(self.reads_probs[i] for i in active):
            if self.probs is None:
                self.probs = probs.new_zeros((*self.tokens.shape, probs.shape[1]))
            self.probs[rows, j] = probs

    def proposals(self, waits, pending_rows: dict[str, int]) -> list[Proposal]:
        """The drafts as proposals, on their way to the host; read at once unless the request's last
        step is still pending (`pending_rows`)."""
        if not self.requests:
            return []
        copy, width = HostCopy(self.tokens.view(-1), waits=waits), self.tokens.shape[1]
        proposals = []
        for i, (r, k) in enumerate(zip(self.requests, self.ks)):
            probs = self.probs[i, :k] if self.probs is not None and self.reads_probs[i] else None
            proposal = Proposal(None, probs, self.tokens[i, :k], (copy, i * width))
            if r.request_id not in pending_rows:
                proposal.host_token_ids()
            proposals.append(proposal)
        return proposals


class DraftProposer:
    def __init__(self, runner: ModelRunner, sampler: Sampler, vocab_size: int):
        self.runner = runner
        self.sampler = sampler  # the engine's: unseeded requests draw from its generator
        self.vocab_size = vocab_size
        self.vocab_token_ids = runner.model.vocab_token_ids  # [draft_vocab]; None: the whole vocabulary

    def full_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        """A reduced draft vocabulary's logits [n, draft_vocab] in the target's columns, -inf
        elsewhere: the draft draws only its own tokens, and q is 0 outside them, which rejection
        sampling needs to stay exact (it only ever sees what the draft could have drawn)."""
        if self.vocab_token_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.vocab_token_ids] = logits
        return full

    def num_available(self, request: Request, k: int) -> int:
        return k

    @staticmethod
    def behind(request: Request) -> int:
        """Tokens a speculating request's first forward reads: what the draft has not, its last included."""
        return request.num_computed_tokens + 1 - request.spec.num_computed_tokens

    @staticmethod
    def catch_up_end(request: Request, num_scheduled: int) -> int:
        """How far a request's draft KV can catch up in a step that computes `num_scheduled` of its
        tokens: alongside the target, short of the last known token (its proposing forward reads it)."""
        return min(request.num_computed_tokens + num_scheduled, request.num_tokens - 1)

    def propose(self, requests: list[Request], ks: list[int], timer: StepTimer | None = None,
                catch_up: list[tuple[Request, int]] = (), pending: PendingTokens | None = None) -> list[Proposal]:
        """k_r draft tokens per request (on the device, and on the host unless a request's last
        step is still pending) and the distributions they were drawn from (None for a greedy
        request: its verification compares argmaxes). `catch_up` (request, end) rows are only
        read, in the first forward: the draft's KV for their tokens up to `end`, no logits."""
        drafts = Drafts(requests, ks, self.runner.device)
        row_of = pending.row_of if pending is not None else {}
        previous: torch.Tensor | None = None  # the last forward's draws, [len(active)]
        previous_active: list[int] = []
        for j in range(max(ks, default=1)):
            started = timer.mark() if timer is not None else None
            active = [i for i, k in enumerate(ks) if k > j]
            if j == 0:
                step = draft_first_input([requests[i] for i in active], pending)
            else:  # one token per request, the one the forward before drew, on the device
                step = StepInput([], [], [], [], device_tokens=previous)
                for i in active:
                    step.add([0], requests[i].num_computed_tokens + j, requests[i].block_table, 1)
                    step.take_from_device([previous_active.index(i)])
            for row, i in enumerate(active):
                requests[i].spec.num_computed_tokens = step.start_positions[row] + len(step.token_ids[row])
            for r, end in catch_up if j == 0 else ():
                step.add(r.tokens_slice(r.spec.num_computed_tokens, end), r.spec.num_computed_tokens, r.block_table, 0)
                r.spec.num_computed_tokens = end
            if pending is not None:  # catch-up rows read known tokens at known positions
                step.position_offsets = pending.corrections([requests[i].request_id for i in active],
                                                            len(step.token_ids))
            logits = self.full_vocabulary(self.runner.run(step))
            if active:
                offsets = step.position_offsets[: len(active)] if step.position_offsets is not None else None
                previous, previous_active = self.draw(requests, active, logits, drafts, j, offsets), active
            if timer is not None:
                timer.span("draft", (j, sum(len(t) for t in step.token_ids), len(active)), started)
        return drafts.proposals(self.runner.waits, row_of)

    def draw(self, requests: list[Request], active: list[int], logits: torch.Tensor, drafts: Drafts, j: int,
             position_offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Sample draft token j for each request[i], i in `active` (logits row by row), through the
        engine's sampler, into `drafts` with its distribution. Returns the tokens.
        A seeded request draws with the noise the target will verify it with at that output index
        (position_offsets [len(active)]: the tokens still on the device, overlapped steps)."""
        drafting = [requests[i] for i in active]
        meta = build_sampling_metadata(drafting, [[] for _ in active], self.vocab_size, self.sampler.generator,
                                       logits.device, constrain=False,  # drafts are verified against the grammar
                                       ahead=j, position_offsets=position_offsets)
        out = self.sampler(logits, meta)
        tokens = out.token_ids[:, 0]
        drafts.put(j, active, tokens, out.probs)
        return tokens
