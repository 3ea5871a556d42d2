"""One generation request and everything the engine keeps about it, from arrival to its last output."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backend.detokenizer import IncrementalDetokenizer
    from backend.proposer import Proposal
    from backend.spec_controller import Survival


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed, back in the waiting queue, recomputed later
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token id or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the model's context
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


FINISHED_STATUSES = frozenset(s for s in RequestStatus if s.value.startswith("finished"))
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class SpecState:
    """A request's speculative decoding, kept by the speculator; reset when it is preempted (its
    draft KV goes with its blocks), counters and measurements kept."""
    # draft tokens to verify this step; None while they are on the device only (`proposal`)
    draft_token_ids: list[int] | None = field(default_factory=list)
    proposal: Proposal | None = None  # the draft model's, as proposed (tokens on the device too)
    num_lookahead_tokens: int = 0  # draft tokens the scheduler reserves room for this step
    num_computed_tokens: int = 0  # tokens whose K/V are in the draft model's pool
    num_draft_tokens: int = 0  # drafted so far
    num_accepted_tokens: int = 0  # of those, accepted
    survival: Survival | None = None  # its own acceptance counts, once it has verified drafts
    expected_yield: np.ndarray | None = None  # E(0..max_k) as this step's plan expects it

    @property
    def drafted_ahead(self) -> bool:
        """Drafted from last step's tokens before they reached the host (its draft's count then
        assumes every verified draft was accepted)."""
        return self.draft_token_ids is None

    def drop_drafts(self) -> None:
        """The draft's KV is gone (preemption): nothing reserved, nothing to verify, read again."""
        self.draft_token_ids, self.num_lookahead_tokens, self.num_computed_tokens = [], 0, 0
        self.proposal = None


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)  # logical block -> physical block id
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    cached_chain_hash: int | None = None  # chain hash of the last of those blocks
    num_pending_tokens: int = 0  # sampled on the device, not read back yet (overlapped steps)
    generator: torch.Generator | None = None  # per-request RNG when params.seed is set
    # timestamps (time.monotonic())
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    spec: SpecState = field(default_factory=SpecState)
    # outputs: the engine detokenizes as tokens come and hands out what is new
    detokenizer: IncrementalDetokenizer | None = None
    num_emitted_tokens: int = 0  # output tokens already handed out
    pending_logprobs: list[dict] = field(default_factory=list)  # logprobs not handed out yet
    cumulative_logprob: float = 0.0  # the chosen tokens' logprobs summed (when logprobs are on)
    num_preemptions: int = 0
    error: str | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens to compute up to: known ones, those still on the device, and draft tokens."""
        return self.num_tokens + self.num_pending_tokens + self.spec.num_lookahead_tokens

    @property
    def length_done_once_pending_land(self) -> bool:
        """The tokens still on the device take the request to max_tokens: nothing left to compute."""
        return self.num_pending_tokens > 0 and self.num_output_tokens + self.num_pending_tokens >= self.params.max_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def tokens_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output + spec tokens, without copying the whole context
        (a decode step asks for the last token or two of a long one)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            tail = self.output_token_ids[start - num_prompt : end - num_prompt]
            missing = end - start - len(tail)
            if missing > 0 and self.spec.draft_token_ids:
                first = max(start - self.num_tokens, 0)
                tail = tail + self.spec.draft_token_ids[first : first + missing]
            return tail
        return (self.prompt_token_ids + self.output_token_ids + self.spec.draft_token_ids)[start:end]
