"""Iteration-level scheduler: one token budget per step, no prefill or decode phases.

Each step every running request asks for the tokens it has not computed yet (1 when decoding,
1 + k when verifying k draft tokens, a chunk while prefilling; with overlapped steps a decoding
request's input may be a token sampled last step and still on the device); waiting requests are then admitted
with whatever budget, sequence slots and blocks are left (chunked prefill). A running request that
cannot get a block preempts the newest running request: its blocks are freed and it goes back to
the head of the waiting queue to be recomputed later. Nothing is ever dropped.

Under pipeline parallelism several batches are in flight at once: a request in one of them
(`busy`) is neither scheduled again nor preempted until its batch's tokens are back, and a batch
takes at most `max_requests` of the running requests, so that they split into as many batches as
the pipeline holds.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field

from backend.core.block_manager import BlockManager
from backend.core.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledBatch:
    requests: list[Request]  # in batch order
    num_scheduled_tokens: list[int]  # same order: tokens computed this step per request
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first; the newest is preempted first
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, busy: Container[str] = (), max_requests: int | None = None) -> ScheduledBatch:
        """This step's batch; `busy`: ids of requests in a batch still in flight."""
        budget = self.max_num_batched_tokens
        room = max_requests or self.max_num_seqs  # requests this batch may still take
        batch = ScheduledBatch([], [])

        i = 0
        while i < len(self.running) and budget > 0 and len(batch) < room:
            request = self.running[i]
            if request.length_done_once_pending_land or request.request_id in busy:
                i += 1
                continue
            num_new = min(request.num_tokens_with_spec - request.num_computed_tokens, budget)
            while not self.block_manager.allocate(request, request.num_computed_tokens + num_new):
                victim = next(r for r in reversed(self.running) if r.request_id not in busy)  # request at worst
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    break
            else:
                batch.requests.append(request)
                batch.num_scheduled_tokens.append(num_new)
                budget -= num_new
                i += 1

        # admit waiting requests, unless this step already had to preempt
        while (self.waiting and budget > 0 and not batch.preempted and len(self.running) < self.max_num_seqs
               and len(batch) < room):
            request = self.waiting[0]
            if request.num_pending_tokens:  # preempted with a token still on the device: next step
                break
            if request.num_computed_tokens == 0:
                request.num_computed_tokens = self.block_manager.match_prefix(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.block_manager.allocate(request, request.num_computed_tokens + num_new):
                self.block_manager.free(request)
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            batch.requests.append(request)
            batch.num_scheduled_tokens.append(num_new)
            budget -= num_new
        return batch

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Finish or abort a request wherever it is; its blocks are freed at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = status
        request.finished_time = time.monotonic()
