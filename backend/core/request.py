"""One generation request and everything the engine keeps about it, from arrival to its last output."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING


from backend.core.spec_state import SpecState
from backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backend.core.detokenizer import IncrementalDetokenizer
    from backend.core.guide import Guide


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
    # a cached block holding the head of its next block's tokens, and how many: copied into its
    # own next block before its first step reads them (BlockManager.take_copies)
    block_copy: tuple[int, int] | None = None
    num_pending_tokens: int = 0  # sampled on the device, not read back yet (overlapped steps)
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
    guide: Guide | None = None  # its grammar state, when params.guided_decoding constrains it

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

    # -- a step's accounting: the engine calls these as a step is launched, sampled and read back
    def computed(self, n: int) -> None:
        """A step computed n more of its tokens (its draft tokens among them, as if accepted)."""
        self.num_computed_tokens += n
        self.spec.num_lookahead_tokens = 0

    def sampled(self, num_drafts: int) -> None:
        """Its next tokens were sampled on the device: its num_drafts drafts verified and one
        more drawn, counted as if every draft is accepted until they reach the host."""
        self.num_pending_tokens += num_drafts + 1
        self.spec.draft_token_ids, self.spec.proposal = [], None

    def landed(self, num_drafts: int, num_accepted: int) -> None:
        """A sampled step's tokens reached the host. Its computed counts assumed every draft
        accepted: the rejected positions come off (and off the draft's, when it drafted ahead from
        those positions before they were known). A preempted request is recomputed from 0."""
        self.num_pending_tokens -= num_drafts + 1
        num_rejected = num_drafts - num_accepted
        if not num_rejected or self.status is not RequestStatus.RUNNING:
            return
        self.num_computed_tokens -= num_rejected
        if self.spec.drafted_ahead:
            self.spec.num_computed_tokens -= num_rejected
        else:
            self.spec.num_computed_tokens = min(self.spec.num_computed_tokens, self.num_computed_tokens)

    def drop_pending(self) -> None:
        """It ends with tokens still on the device, or with drafts reserved: none of them count."""
        self.num_pending_tokens = 0
        self.spec.draft_token_ids, self.spec.num_lookahead_tokens = [], 0

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
