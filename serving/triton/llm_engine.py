"""llm_engine: a decoupled Python backend model, a thin adapter around backend.EngineLoop (or, with
the `engine_process` parameter, backend.EngineCoreClient: the engine in a process of its own).

`execute()` hands each request to the engine thread and returns None at once. The engine thread
calls back with every RequestOutput; those go through a queue to the dispatcher thread, which
builds the responses (a text delta per output when streaming, one response otherwise) and hands
them to the request's sender lane (sender_lane.py: a send to a stuck receiver blocks only its lane,
and a lane stuck for SEND_TIMEOUT_S is replaced, its stuck request abandoned and aborted). The
dispatcher also polls `is_cancelled()` (a few requests per poll, in turn) and aborts cancelled
requests in the engine. Every request ends with exactly one response flagged COMPLETE_FINAL,
errors and cancellations included (an abandoned request's receiver cannot take it).

A request whose request_options set `in_band_errors` (llm_bls sets it) gets an error that ends it
after its first response as a last response with finish_reason "error" and an `error` output:
tritonserver 2.51's python backend never hands a BLS caller an error response that follows another
response (the caller waits for ever), and a gRPC stream's error carries no Triton code, which the
error's text (backend/errors.py) then stands for. An error as the first response reaches it.

A request carrying `abort_request_id` is a control request: it aborts the requests in flight that
were sent with that Triton request id and the same `abort_key` (serving/triton/abort_key.py: only the
sender knows it), on whichever instance holds them (serving/triton/abort_channel.py; the engine frees
their KV blocks at once), and gets one empty final response. The models in front
(preprocessing for `llm`, llm_bls) deliver their aborts through the same channel themselves, so
that an abort never waits in Triton's queue.

Several instances (instance_group count N): each runs its own engine, on the device that
serving/triton/device_map.py gives it, and labels its metrics with its instance name. With
`max_pending_requests`, execute() holds Triton's next request while this instance has more than
that many requests not started (serving/triton/admission_gate.py), so Triton's queue hands work to the
instance that can start it.
"""
from __future__ import annotations

import itertools
import json
import os
import queue
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.core.fault_injection import fault_hook_from_env
from backend.engine import LLMEngine
from backend.engine_driver import EngineDriver
from backend.engine_loop import EngineLoop
from backend.errors import INTERNAL_ERROR, SHUTTING_DOWN
from backend.outputs import RequestOutput
from backend.process.engine_core_client import EngineCoreClient
from serving.triton.abort_channel import AbortListener, abort_everywhere, instances_directory
from serving.triton.abort_key import checked_abort_key, key_digest, proves, require_stop_key
from serving.triton.admission_gate import AdmissionGate
from serving.triton.early_aborts import EarlyAborts
from serving.triton.engine_metrics import EngineMetrics
from serving.triton.llm_engine_io import (
    FINAL, bytes_tensor, engine_config, engine_request, final_error, format_traceback, input_text, json_object,
    refuse, uint32_tensor, vllm_logprobs,
)
from serving.triton.request_state import RequestState
from serving.triton.sender_lane import PendingSend, SenderLane
from serving.triton.startup_heap import freeze_startup_heap
from serving.triton.triton_log import forward_engine_logs

# How often the sender checks requests for cancellation and refreshes the gauges. Each check is
# a round trip to the server, so one poll checks at most CANCEL_CHECKS_PER_POLL requests, taking
# turns: with hundreds queued, checking all of them every poll cost ~10% of the throughput.
POLL_INTERVAL_S = 0.05
CANCEL_CHECKS_PER_POLL = 16
# Sends are spread over this many lanes; a send that has waited SEND_TIMEOUT_S (a healthy one takes
# well under a millisecond) marks its receiver stuck: its lane is replaced, its request abandoned.
NUM_SENDER_LANES = 4
SEND_TIMEOUT_S = 10.0
# A failed instance (its engine dead, other instances serving) refuses what it is handed with
# UNAVAILABLE and then holds execute() this long, so that Triton hands the next requests to others.
FAILED_INSTANCE_HOLD_S = 1.0
_STOP = object()


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                "llm_engine must be decoupled: model_transaction_policy { decoupled: true }"
            )
        forward_engine_logs()
        config, engine_process, max_pending = engine_config(args, model_config)
        self.model_name = args["model_name"]
        self.instance_name = args.get("model_instance_name") or self.model_name
        where = "in its own process" if engine_process else "in this process"
        pb_utils.Logger.log_info(f"llm_engine: {self.instance_name} starting engine {where} with {config}")
        fault_hook = fault_hook_from_env(os.environ.get("SPECSERVE_FAULT_INJECTION"))
        if fault_hook is not None:
            pb_utils.Logger.log_warn("llm_engine: test fault injection is on (SPECSERVE_FAULT_INJECTION)")
        self.loop: EngineDriver  # the only way this model reaches its engine
        if engine_process:  # the engine core reads SPECSERVE_FAULT_INJECTION itself
            self.loop = EngineCoreClient(config)
        else:
            def make_engine() -> LLMEngine:
                engine = LLMEngine(config)
                engine.fault_hook = fault_hook
                return engine

            self.loop = EngineLoop.build(make_engine)  # built on the thread that steps it
        self.unloading = False  # the engine died and this model asked Triton to unload it
        self.others_serve = False  # the engine died while other instances serve on
        self.closing = False  # finalize() has begun
        self.gate = AdmissionGate(max_pending)
        self.metrics = EngineMetrics(
            {"model": args["model_name"], "version": args["model_version"], "model_instance": self.instance_name}
        )
        self.requests: dict[str, RequestState] = {}  # request id -> state; sender thread owns it
        self.early_aborts = EarlyAborts()  # stops that found nothing in flight (yet)
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()  # (time, RequestOutput) or _STOP
        self.cancel_cursor = 0  # where the next cancellation poll starts in self.requests
        self.loop.start()
        self.lanes = [
            SenderLane(f"specserve-sender-{i}", self._send_failed, self._end_abandoned)
            for i in range(NUM_SENDER_LANES)
        ]
        self.next_lane = itertools.count()  # execute()'s thread only
        self.sender = threading.Thread(target=self._send_loop, name="specserve-dispatcher", daemon=True)
        self.sender.start()
        self.aborts = AbortListener(self.model_name, self.instance_name, self._abort_by_triton_id)
        pb_utils.Logger.log_info(
            f"llm_engine: ready, max_model_len {self.loop.max_model_len}, "
            f"{self.loop.stats().num_total_blocks} KV blocks"
        )
        freeze_startup_heap()

    # -- Triton's thread: hand off, then wait only for room (max_pending_requests) ----------------
    def execute(self, requests):
        for request in requests:
            try:
                self._submit(request)
            except Exception as e:  # a malformed abort_request_id, or a bug
                try:
                    refuse(request.get_response_sender(), e)
                except Exception:
                    pass  # it was answered already
        self.gate.wait_for_room(lambda: self.closing or self.loop.dead)
        if self.others_serve and not self.closing:
            time.sleep(FAILED_INSTANCE_HOLD_S)  # busy to Triton: the instances still serving get the work
        return None

    def _submit(self, request) -> None:
        arrival = time.monotonic()
        sender = request.get_response_sender()
        abort_request_id = input_text(request, "abort_request_id")
        abort_key = checked_abort_key(input_text(request, "abort_key"))
        if abort_request_id:
            require_stop_key(abort_key)
            delivered = (json_object(request, "request_options") or {}).get("abort_delivered") is True
            if not delivered and not abort_everywhere(self.model_name, abort_request_id, abort_key):
                self._abort_by_triton_id(abort_request_id, abort_key)  # no listener answered: this instance at least
            sender.send(flags=FINAL)
            return
        triton_request_id = request.request_id()
        digest = key_digest(abort_key)
        if digest and self.early_aborts.take(triton_request_id, digest, arrival):
            sender.send(flags=FINAL)
            return
        request_id = uuid.uuid4().hex
        try:
            prompt_ids, params, options, prompt_text = engine_request(request)
            lane = next(self.next_lane) % NUM_SENDER_LANES
            state = RequestState(request_id, sender, lane, triton_request_id, digest, options, prompt_text, arrival)
            state.echo_pending = not options.get("exclude_input_in_output", True)
            self.requests[request_id] = state  # before submit: outputs may come back at once
            self.gate.taken()
            self.loop.submit(prompt_ids, params, self._on_output, request_id)
        except Exception as e:
            if self.requests.pop(request_id, None) is not None:
                self.gate.started()  # it never will
            refuse(sender, e)

    def _abort_by_triton_id(self, triton_request_id: str, abort_key: str) -> None:
        """Abort every request in flight sent with this Triton request id and abort key (on the
        abort channel's thread). The engine ends each with a final output (finish_reason "abort"),
        which the sender thread passes on. A stop that matches nothing is remembered a while."""
        try:
            engine_ids = [
                request_id
                for request_id, state in list(self.requests.items())
                if state.triton_request_id == triton_request_id and proves(state.abort_key_digest, abort_key)
            ]
            for request_id in engine_ids:
                self.loop.abort(request_id)
            if not engine_ids and abort_key:
                self.early_aborts.remember(triton_request_id, key_digest(abort_key))
        except Exception as e:
            pb_utils.Logger.log_error(f"llm_engine: abort of {triton_request_id!r} failed: {format_traceback(e)}")

    # -- engine thread: enqueue only ------------------------------------------------------------
    def _on_output(self, output: RequestOutput) -> None:
        self.outputs.put((time.monotonic(), output))

    # -- sender thread ----------------------------------------------------------------------------
    def _send_loop(self) -> None:
        next_poll = 0.0
        while True:
            try:
                item = self.outputs.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            try:  # one bad output or metric update must not stop every request's responses
                if item is not None:
                    self._handle(*item)
                now = time.monotonic()
                if now >= next_poll:
                    next_poll = now + POLL_INTERVAL_S
                    self._check_cancelled()
                    self.metrics.refresh(self.loop.stats())
                    self._replace_stuck_lanes(now)
                    if self.loop.dead and not self.unloading:
                        self._unload()
            except Exception as e:
                pb_utils.Logger.log_error(f"llm_engine: sender: {format_traceback(e)}")

    def _replace_stuck_lanes(self, now: float) -> None:
        """A lane whose send has waited SEND_TIMEOUT_S: its request is abandoned (aborted in the
        engine, nothing more sent), its other requests go on in a fresh lane."""
        for i, lane in enumerate(self.lanes):
            stuck = lane.stuck(now, SEND_TIMEOUT_S)
            if stuck is None:
                continue
            state = stuck.state
            pb_utils.Logger.log_error(
                f"llm_engine: a response to request {state.request_id} has waited {SEND_TIMEOUT_S:.0f} s "
                "for its receiver; abandoning that request"
            )
            state.abandoned = True
            self.loop.abort(state.request_id)
            self.lanes[i] = lane.hand_over()

    def _send(self, state: RequestState, response=None, flags: int = 0) -> None:
        self.lanes[state.lane].put(PendingSend(state, response, flags))

    def _send_failed(self, item: PendingSend, error: Exception) -> None:
        """On a lane's thread: a send raised. A final response must still end the request."""
        pb_utils.Logger.log_warn(f"llm_engine: sending a response failed: {format_traceback(error)}")
        if item.flags & FINAL:
            try:
                item.state.sender.send(final_error(item.state.options, INTERNAL_ERROR), flags=FINAL)
            except Exception:
                pass  # the client is gone

    def _end_abandoned(self, item: PendingSend) -> None:
        """On a retired lane's thread: the stuck send returned at last. Unless it was the final
        response, the abandoned request still needs one."""
        if not item.flags & FINAL:
            try:
                item.state.sender.send(final_error(item.state.options, INTERNAL_ERROR), flags=FINAL)
            except Exception:
                pass  # the client is gone

    def _unload(self) -> None:
        """The engine died. While another instance serves, this one leaves the abort channel and
        answers what Triton still hands it with UNAVAILABLE (clients retry; the others carry on).
        The last instance to die has Triton unload the model, so that it reports not ready (as
        vllm_backend does on a failed health check). Needs --model-control-mode=explicit; until
        then (or without it) every new request gets UNAVAILABLE at once."""
        self.unloading = True
        self.aborts.close()  # the channel's directory now lists the instances still serving
        serving = sorted(p.stem for p in instances_directory(self.model_name).glob("*.ipc"))
        if serving:
            self.others_serve = True
            pb_utils.Logger.log_error(
                f"llm_engine: the engine of {self.instance_name} has failed; {', '.join(serving)} serve on"
            )
            return
        pb_utils.Logger.log_error(f"llm_engine: the engine has failed; unloading {self.model_name}")
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as e:
            pb_utils.Logger.log_error(f"llm_engine: could not unload {self.model_name}: {e}")

    def _check_cancelled(self) -> None:
        """Check the next CANCEL_CHECKS_PER_POLL requests (in arrival order, wrapping around)."""
        request_ids = list(self.requests)
        if not request_ids:
            return
        start = self.cancel_cursor % len(request_ids)
        turn = (request_ids[start:] + request_ids[:start])[:CANCEL_CHECKS_PER_POLL]
        self.cancel_cursor = start + len(turn)
        for request_id in turn:
            state = self.requests.get(request_id)
            if state is not None and not state.cancelled and state.sender.is_cancelled():
                state.cancelled = True
                self.loop.abort(request_id)  # the engine frees the blocks and sends a final output

    def _handle(self, now: float, output: RequestOutput) -> None:
        state = self.requests.get(output.request_id)
        if state is None:
            return
        if not state.started:
            state.started = True
            self.gate.started()
        if output.token_ids:
            self._observe_latency(state, now, len(output.token_ids))
        if output.finished:
            del self.requests[output.request_id]
            self.metrics.request_finished(output.finish_reason or "error", now - state.arrival, output.queue_seconds)
            self.metrics.refresh(self.loop.stats())
        if output.logprobs:
            state.logprobs.extend(output.logprobs)
        state.unsent_tokens += len(output.token_ids)
        try:
            self._respond(state, output)
        except Exception as e:
            pb_utils.Logger.log_warn(f"llm_engine: building a response failed: {format_traceback(e)}")
            if output.finished:  # the request must still end, or its client waits forever
                self._send(state, final_error(state.options, INTERNAL_ERROR), FINAL)

    def _observe_latency(self, state: RequestState, now: float, num_new_tokens: int) -> None:
        if state.last_token_time is None:
            self.metrics.time_to_first_token.observe(now - state.arrival)
            num_new_tokens -= 1
        if num_new_tokens > 0 and state.last_token_time is not None:
            per_token = (now - state.last_token_time) / num_new_tokens
            for _ in range(num_new_tokens):
                self.metrics.inter_token_latency.observe(per_token)
        state.last_token_time = now

    def _respond(self, state: RequestState, output: RequestOutput) -> None:
        if output.finished and output.finish_reason == "error":
            self._send(state, final_error(state.options, output.error or INTERNAL_ERROR), FINAL)
            return
        if output.finished and state.cancelled:
            self._send(state, flags=FINAL)
            return
        if not state.options.get("stream", False):
            state.text.append(output.text)
            if output.finished:
                self._send(state, self._response(state, "".join(state.text), output), FINAL)
            return
        if output.text or output.finished:
            flags = FINAL if output.finished else 0
            self._send(state, self._response(state, output.text, output), flags)

    def _response(self, state: RequestState, text: str, output: RequestOutput):
        """One response, with the outputs asked for as vllm_backend gives them: finish_reason
        "None" until the last response, num_output_tokens and logprobs for the tokens since the
        previous response, logprobs null unless the sampling parameter `logprobs` was given."""
        if state.echo_pending:
            text, state.echo_pending = state.prompt_text + text, False
        options = state.options
        tensors = [bytes_tensor("text_output", text)]
        if options.get("return_finish_reason"):
            tensors.append(bytes_tensor("finish_reason", str(output.finish_reason if output.finished else None)))
        if options.get("return_cumulative_logprob"):
            value = output.cumulative_logprob or 0.0
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.array([value], dtype=np.float32)))
        if options.get("return_logprobs"):
            entries = None if options.get("null_logprobs") else [vllm_logprobs(e) for e in state.logprobs]
            tensors.append(bytes_tensor("logprobs", json.dumps(entries)))
        if options.get("return_output_log_probs"):  # TensorRT-LLM's: [beam, tokens]
            values = [[e["logprob"] for e in state.logprobs]]
            tensors.append(pb_utils.Tensor("output_log_probs", np.array(values, dtype=np.float32)))
        if options.get("return_batch_index"):
            tensors.append(pb_utils.Tensor("batch_index", np.zeros((1, 1), dtype=np.int32)))
        state.logprobs = []
        if options.get("return_num_input_tokens"):
            tensors.append(uint32_tensor("num_input_tokens", output.num_prompt_tokens))
        if options.get("return_num_output_tokens"):
            tensors.append(uint32_tensor("num_output_tokens", state.unsent_tokens))
        state.unsent_tokens = 0
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        """Abort what is in flight (each request still gets its final response), stop threads."""
        self.closing = True
        self.aborts.close()
        self.loop.shutdown()
        self.outputs.put(_STOP)
        self.sender.join(timeout=30)
        for lane in self.lanes:  # their queued sends first
            lane.stop(timeout=10)
        for state in self.requests.values():
            if not state.abandoned:
                state.sender.send(final_error(state.options, SHUTTING_DOWN), flags=FINAL)
        self.requests.clear()


