"""What the engine hands back: per request per iteration, and its totals (`LLMEngine.stats()`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    text: str  # new text since the previous output of this request (a delta)
    # the tokens whose text this output hands out (a token that may begin a stop string waits)
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    # per token of token_ids: {"token_id", "logprob", "rank" (1: the most likely), "top": {id: lp}
    # (the n most likely), "text": {id: its text} (the chosen token's part of the text, which the
    # chosen ones of an output join to; for the others, what each would have added instead)}
    logprobs: list[dict] | None = None
    cumulative_logprob: float | None = None  # the sum over the tokens handed out so far, when logprobs are on
    error: str | None = None  # set when finish_reason == "error"
    num_draft_tokens: int = 0  # total proposed by speculation so far
    num_accepted_tokens: int = 0  # total accepted so far
    queue_seconds: float | None = None  # on the final output: arrival to first scheduled (None: never scheduled)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # 0..1
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions_total: int
    prefix_cache_hit_tokens_total: int
    prefix_cache_query_tokens_total: int
    spec_draft_tokens_total: int
    spec_accepted_tokens_total: int
    spec_accepted_per_position: list[int]  # draft position i -> tokens accepted there
    graph_replays_total: int = 0  # steps (target and draft forwards) that replayed a CUDA graph
    host_waits_total: int = 0  # waits of the host for the device (host_waits.py)
