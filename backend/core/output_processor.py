"""Output processing: a request's new tokens appended one at a time (stops, EOS, length, the
detokenizer's stop strings), its logprob entries made readable, and its output since the last one.

A logprob entry spells its tokens as the text does: the chosen token as the part of the text it
added (skip_special_tokens, the same spaces, "" for an EOS, cut where a stop string begins; the
entries of the tokens that carry a stop string stay, as vLLM keeps them), the others as what each
would have added in its place. An output hands out its tokens, their text and their entries
together, so the entries of every output spell its text.

The engine hands each read-back request's tokens to `advance`; a fault of the request's own fails
it alone (`fail`); `output` also forgets a finished request.
"""
from __future__ import annotations

import logging
import time

from backend.core.block_manager import BlockManager
from backend.core.fault_injection import FaultHook
from backend.core.request import Request, RequestStatus
from backend.core.scheduler import Scheduler
from backend.errors import INTERNAL_ERROR, is_fatal
from backend.outputs import RequestOutput

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, requests: dict[str, Request],
                 max_model_len: int):
        self.scheduler = scheduler  # finishes requests (their blocks freed)
        self.block_manager = block_manager
        self.requests = requests  # the engine's: a finished request leaves it with its last output
        self.max_model_len = max_model_len
        self.fault_hook: FaultHook | None = None  # tests: make chosen requests raise in a step
        self.generation_tokens_total = 0

    def logprob_entry(self, entry: tuple[float, int, list[int], list[float]] | None, token: int,
                       n: int | None) -> dict | None:
        if entry is None or n is None:
            return None
        chosen, rank, top_ids, top_values = entry
        top = dict(zip(top_ids[:n], top_values[:n]))
        return {"token_id": token, "logprob": chosen, "rank": rank, "top": top}  # "text" as it is appended

    def advance(
        self, request: Request, tokens: list[int], logprobs: list[dict | None], error: Exception | None, trim: bool = False
    ) -> RequestOutput:
        """Append a request's new tokens, cache its full blocks, finish it if it is done; its output.
        A fault of its own (`error`, from sampling, or raised here) fails it alone."""
        try:
            if error is not None:
                raise error
            self._append_tokens(request, tokens, logprobs)
            if trim and not request.is_finished:
                self.block_manager.trim(request, request.num_tokens)
            # before a finish frees them: a request done in the step that computed its prompt
            # (max_tokens=1, a classifier's one token) leaves its prefix for the next
            self.block_manager.cache_full_blocks(request)
            if request.is_finished:
                self.scheduler.finish(request, request.status)
            return self.output(request)
        except Exception as e:
            if is_fatal(e):
                raise
            return self.fail(request, e)

    def fail(self, request: Request, error: Exception) -> RequestOutput:
        """End one request with an internal error (the detail goes to the log); its batch-mates
        go on as if it had finished."""
        log.error("request %s failed in a step; the others go on", request.request_id, exc_info=error)
        request.drop_pending()
        request.error = INTERNAL_ERROR
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        return self.output(request)

    def _append_tokens(self, request: Request, tokens: list[int], logprobs: list[dict | None]) -> None:
        """Append tokens one at a time, stopping exactly where the request finishes."""
        if self.fault_hook is not None:
            self.fault_hook(request)
        detok = request.detokenizer
        p = request.params
        for token, lp in zip(tokens, logprobs):
            if request.guide is not None:
                request.guide.accept(token)
            request.output_token_ids.append(token)
            if lp is not None:
                lp["text"] = detok.candidate_texts(t for t in lp["top"] if t != token)
                request.pending_logprobs.append(lp)
            self.generation_tokens_total += 1
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            stop_string = detok.add_token(token)
            n_out = request.num_output_tokens
            stopped = stop_string or (
                n_out >= p.min_tokens
                and (token in p.stop_token_ids or (token in request.eos_token_ids and not p.ignore_eos))
            )
            if stopped:
                request.status = RequestStatus.FINISHED_STOPPED
            elif n_out >= p.max_tokens or request.num_tokens >= self.max_model_len:
                request.status = RequestStatus.FINISHED_LENGTH
            if request.is_finished:
                return

    def output(self, request: Request) -> RequestOutput:
        """The request's news since its previous output; forgets the request once finished."""
        rid = request.request_id
        finished = request.is_finished
        detok = request.detokenizer
        text = "" if request.error else detok.take_delta(finished)
        start = request.num_emitted_tokens
        request.num_emitted_tokens = request.num_output_tokens if finished else detok.num_emitted_tokens
        logprobs = request.pending_logprobs[: request.num_emitted_tokens - start]
        del request.pending_logprobs[: len(logprobs)]
        for lp, token_text in zip(logprobs, detok.token_texts(start, request.num_emitted_tokens)):
            lp["text"][lp["token_id"]] = token_text
            request.cumulative_logprob += lp["logprob"]
        out = RequestOutput(
            request_id=rid,
            text=text,
            token_ids=request.output_token_ids[start : request.num_emitted_tokens],
            finished=finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            logprobs=logprobs or None,
            cumulative_logprob=request.cumulative_logprob if request.params.logprobs is not None else None,
            error=request.error,
            num_draft_tokens=request.spec.num_draft_tokens,
            num_accepted_tokens=request.spec.num_accepted_tokens,
        )
        if finished and request.first_scheduled_time is not None:
            out.queue_seconds = request.first_scheduled_time - request.arrival_time
        if finished:
            del self.requests[rid]
        return out
