"""Every step's inputs, the target's and the draft's: the one place that knows which of a
request's tokens are still on the device and where they go.

With overlapped steps a request's last step may still be on the device when the next one is
built: its sampled token (and, after a verification, how many drafts survived) is known only
there. `PendingTokens` holds that step's tokens on the device; the next step reads them in place
(`StepInput.take_from_device`) at positions that assume every draft was accepted, corrected on
the device by `offsets` (0 or minus the drafts rejected). A request with nothing pending reads
its tokens from the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.core.request import Request
from backend.core.scheduler import ScheduledBatch
from backend.model.model_runner import StepInput
from backend.sample.sampler import PLACEHOLDER_TOKEN
from backend.sample.sampling_metadata import SamplingMetadata
from backend.uploads import on_device


@dataclass(slots=True)
class PendingTokens:
    """The tokens the step before this one produced, still on the device."""
    row_of: dict[str, int]  # request id -> its row below
    num_drafts: list[int]  # per row: the drafts it verified (0: its one token was sampled)
    previous: torch.Tensor  # [B] int64: the token before the last (the draft re-reads it)
    last: torch.Tensor  # [B] int64: the last token (sampled, recovered or bonus)
    offsets: torch.Tensor  # [B] int64: minus the number of its drafts rejected (0 without drafts)

    @classmethod
    def of_step(cls, meta: SamplingMetadata, token_ids: torch.Tensor, last_known: list[int]) -> PendingTokens:
        """What the next step needs of a sampled step's tokens before they reach the host.
        token_ids: [B, max_k + 1], PLACEHOLDER_TOKEN past each request's last; last_known: per
        request, its last token on the host (the input of its first row)."""
        num_accepted = (token_ids != PLACEHOLDER_TOKEN).sum(1) - 1  # [B]
        last = token_ids.gather(1, num_accepted[:, None])[:, 0]
        before = token_ids.gather(1, (num_accepted - 1).clamp_min(0)[:, None])[:, 0]
        known = on_device(last_known, token_ids.device, torch.int64)
        previous = torch.where(num_accepted > 0, before, known)
        row_of = {r.request_id: i for i, r in enumerate(meta.requests)}
        return cls(row_of, meta.num_drafts, previous, last, num_accepted - meta.num_drafts_t)

    def corrections(self, request_ids: list[str], num_rows: int) -> torch.Tensor | None:
        """[num_rows] position offsets for a step whose first rows are `request_ids` (0 for the
        rest, and for requests with nothing pending); None when no draft was verified, so every
        offset is 0."""
        if not any(self.num_drafts):
            return None
        table = torch.cat([self.offsets, self.offsets.new_zeros(1)])
        index = [self.row_of.get(rid, len(self.row_of)) for rid in request_ids]
        index += [len(self.row_of)] * (num_rows - len(request_ids))
        return table[on_device(index, table.device, torch.int64)]


def target_input(batch: ScheduledBatch, pending: PendingTokens | None) -> StepInput:
    """The target's step. A request whose last step is still on the device reads that step's last
    token from there; draft tokens the host does not hold yet come from the device too."""
    step = StepInput([], [], [], [])
    row_of = pending.row_of if pending is not None else {}
    sources = [pending.last] if pending is not None else []  # cat() of these feeds from_device
    num_sources = len(row_of)
    for request, n in zip(batch.requests, batch.num_scheduled_tokens):
        start = request.num_computed_tokens
        spec = request.spec
        k = spec.num_lookahead_tokens
        on_device = request.num_pending_tokens > 0  # its last input was sampled last step
        known = request.num_tokens + request.num_pending_tokens  # tokens once the device's land
        num_logits = start + n - known + 1 if start + n >= known else 0
        if not on_device and spec.draft_token_ids is not None:
            step.add(request.tokens_slice(start, start + n), start, request.block_table, num_logits)
            continue
        tokens = [0] if on_device else request.tokens_slice(start, start + n - k)
        at, device = ([0], [row_of[request.request_id]]) if on_device else ([], [])  # token index -> source
        if spec.draft_token_ids is not None:
            tokens += spec.draft_token_ids[:k]
        else:  # drafted from tokens still on the device: the drafts are there too
            at += range(len(tokens), len(tokens) + k)
            tokens += [0] * k
            sources.append(spec.proposal.device_token_ids[:k])
            device += range(num_sources, num_sources + k)
            num_sources += k
        step.add(tokens, start, request.block_table, num_logits)
        step.take_from_device(device, at)
    if step.from_device:
        step.device_tokens = torch.cat(sources)
    if pending is not None:
        step.position_offsets = pending.corrections([r.request_id for r in batch.requests], len(batch.requests))
    return step


def draft_first_input(requests: list[Request], pending: PendingTokens | None) -> StepInput:
    """The draft's first forward of a step: each request reads what the draft has not seen of it.
    After a verification still on the device, that is the token before the last and the last,
    where the accepted drafts put them (re-reading a position already computed writes the same
    K/V); after a plain step, what it has not read and the sampled token from the device. With
    every step read back, at least the last two tokens: after a verification the draft has seen
    all but the last (some drafts rejected) or all but two (every draft accepted), and reading two
    either way keeps the forward one graph's shape (mixed, it would run eagerly)."""
    step = StepInput([], [], [], [])
    row_of = pending.row_of if pending is not None else {}
    if pending is not None:
        step.device_tokens = torch.cat([pending.previous, pending.last])
    for r in requests:
        row = row_of.get(r.request_id)
        if row is not None and pending.num_drafts[row]:
            step.add([0, 0], r.num_computed_tokens - 1, r.block_table, 1)
            step.take_from_device([row, len(row_of) + row])
        else:
            start = max(0, min(r.spec.num_computed_tokens, r.num_tokens - (1 if row is not None else 2)))
            step.add(r.tokens_slice(start, r.num_tokens) + ([0] if row is not None else []), start, r.block_table, 1)
            if row is not None:
                step.take_from_device([len(row_of) + row])
    return step
