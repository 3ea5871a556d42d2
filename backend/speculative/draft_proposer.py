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
        drawn: list[list[torch.Tensor]] = [[] for _ in requests]  # per request: [1] device tokens
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
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
                previous, previous_active = self.draw(requests, active, logits, drawn, probs, j, offsets), active
            if timer is not None:
                timer.span("draft", (j, sum(len(t) for t in step.token_ids), len(active)), started)
        return self.proposals(requests, ks, drawn, probs, row_of)

    def draw(self, requests: list[Request], active: list[int], logits: torch.Tensor,
             drawn: list[list[torch.Tensor]], probs: list[list[torch.Tensor]], j: int,
             position_offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Sample draft token j for each request[i], i in `active` (logits row by row), through the
        engine's sampler; appends it to drawn[i] and its distribution to probs[i]. Returns the tokens.
        A seeded request draws with the noise the target will verify it with at that output index
        (position_offsets [len(active)]: the tokens still on the device, overlapped steps)."""
        drafting = [requests[i] for i in active]
        meta = build_sampling_metadata(drafting, [[] for _ in active], self.vocab_size, self.sampler.generator,
                                       logits.device, constrain=False,  # drafts are verified against the grammar
                                       ahead=j, position_offsets=position_offsets)
        out = self.sampler(logits, meta)
        tokens = out.token_ids[:, 0]
        for row, i in enumerate(active):
            drawn[i].append(tokens[row : row + 1])
            p = requests[i].params
            if not p.greedy and p.seed is None:  # greedy and seeded verifications compare tokens only
                probs[i].append(out.probs[row])
        return tokens

    def proposals(self, requests: list[Request], ks: list[int], drawn: list[list[torch.Tensor]],
                  probs: list[list[torch.Tensor]], row_of: dict[str, int]) -> list[Proposal]:
        """The drafts as proposals, on their way to the host; read at once unless the request's last
        step is still pending (`row_of`)."""
        device_ids = [torch.cat(d) for d in drawn]
        proposals = [Proposal(None, torch.stack(p) if p else None, d) for p, d in zip(probs, device_ids)]
        if proposals:
            copy, offset = HostCopy(torch.cat(device_ids), waits=self.runner.waits), 0
            for r, proposal, k in zip(requests, proposals, ks):
                proposal.host_copy, offset = (copy, offset), offset + k
                if r.request_id not in row_of:
                    proposal.host_token_ids()
        return proposals
