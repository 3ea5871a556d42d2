"""Iteration-level scheduler: one token budget per step, no prefill or decode phases.

Each step every running request asks for the tokens it has not computed yet (1 when decoding,
1 + k when verifying k draft tokens, a chunk while prefilling; with overlapped steps a decoding
request's input may be a token sampled last step and still on the device); waiting requests are then admitted
with whatever budget, sequence slots and blocks are left (chunked prefill). A running request that
cannot get a block preempts the newest running request: its blocks are freed and it goes back to
the head of the waiting queue to be recomputed later. Nothing is ever dropped.

Priorities (`SamplingParams.priority`, vLLM's: lower first): the waiting queue is kept in priority
order (arrival order within one priority; a preempted request goes to the head of its priority),
a step serves requests best priority first (running before waiting within one priority, so a
waiting request of a better priority is admitted before a worse one's prefill chunk takes the
budget), and the victim of a preemption is the worst priority's newest request. With one priority
for all, this is plain first-come first-served.

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
        self.running: list[Request] = []  # oldest first; the newest (of the worst priority) is preempted first
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queue behind every waiting request of its priority or better."""
        priority = request.params.priority
        index = next((i for i, r in enumerate(self.waiting) if r.params.priority > priority), len(self.waiting))
        self.waiting.insert(index, request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, busy: Container[str] = (), max_requests: int | None = None) -> ScheduledBatch:
        """This step's batch; `busy`: ids of requests in a batch still in flight."""
        budget = self.max_num_batched_tokens
        room = max_requests or self.max_num_seqs  # requests this batch may still take
        batch = ScheduledBatch([], [])
        admitting = True  # waiting requests are admitted until one cannot be, or a preemption
        # best priority first; running before waiting within one (each list keeps its order)
        order = sorted([(r.params.priority, 0, i, r) for i, r in enumerate(self.running)]
                       + [(r.params.priority, 1, i, r) for i, r in enumerate(self.waiting)], key=lambda e: e[:3])
        for _, waiting, _, request in order:
            if budget <= 0 or len(batch) >= room:
                break
            if not waiting:
                if request.status is not RequestStatus.RUNNING:  # preempted by a request before it
                    continue
                budget -= self._schedule_running(request, batch, busy, budget)
            elif admitting:
                admitted = self._admit(request, batch, budget)
                admitting = admitted > 0
                budget -= admitted
        return batch

    def _schedule_running(self, request: Request, batch: ScheduledBatch, busy: Container[str], budget: int) -> int:
        """Schedule a running request's tokens, preempting the worst request for blocks if need be
        (perhaps itself); returns the tokens scheduled."""
        if request.length_done_once_pending_land or request.request_id in busy:
            return 0
        num_new = min(request.num_tokens_with_spec - request.num_computed_tokens, budget)
        while not self.block_manager.allocate(request, request.num_computed_tokens + num_new):
            victim = self._victim(busy)
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is request:
                return 0
        batch.requests.append(request)
        batch.num_scheduled_tokens.append(num_new)
        return num_new

    def _victim(self, busy: Container[str]) -> Request:
        """The request at worst: the worst priority's newest, not in flight."""
        candidates = [(r.params.priority, i) for i, r in enumerate(self.running) if r.request_id not in busy]
        return self.running[max(candidates)[1]]

    def _admit(self, request: Request, batch: ScheduledBatch, budget: int) -> int:
        """Admit a waiting request with a chunk of its prompt; returns its tokens, 0 if it cannot
        be admitted (then no later one is this step)."""
        if batch.preempted or len(self.running) >= self.max_num_seqs:
            return 0
        if request.num_pending_tokens:  # preempted with a token still on the device: next step
            return 0
        if request.num_computed_tokens == 0:
            request.num_computed_tokens = self.block_manager.match_prefix(request)
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if not self.block_manager.allocate(request, request.num_computed_tokens + num_new):
            self.block_manager.free(request)
            request.num_computed_tokens = 0
            return 0
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.running.append(request)
        batch.requests.append(request)
        batch.num_scheduled_tokens.append(num_new)
        return num_new

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        priority = request.params.priority  # to the head of its priority
        index = next((i for i, r in enumerate(self.waiting) if r.params.priority >= priority), len(self.waiting))
        self.waiting.insert(index, request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Finish or abort a request wherever it is; its blocks are freed at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = status
        request.finished_time = time.monotonic()
