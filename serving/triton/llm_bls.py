"""llm_bls: `llm`'s inputs and outputs as a decoupled Python model over llm_engine that can be cancelled.

tritonserver 2.51 checks an ensemble request for cancellation only between steps, and its Python
backend cannot cancel a BLS request. So this model does the `llm` ensemble's work itself and
cancels through the abort channel to every llm_engine instance (serving/triton/abort_channel.py).

`execute()` reads each request's inputs, hands them to a worker thread and returns None. The worker
1. preprocesses them in-process with the `preprocessing` model's own code (a bad input ends the
   request with INVALID_ARG);
2. sends llm_engine the request on a gRPC stream of its own to this server (serving/triton/engine_stream.py
   says why not through BLS), under a fresh Triton request id;
3. relays each engine response to the client as it comes, the last one flagged COMPLETE_FINAL.
A cancelled client request (checked between responses, and by the watcher thread while a response
is awaited) gets an abort sent to llm_engine's instances, which free its KV blocks at once; the
worker then closes the engine stream and ends the client request with an empty final response.
Every request ends with exactly one COMPLETE_FINAL. (The model keeps its name, which clients use,
from when it reached llm_engine through BLS.)
"""
from __future__ import annotations

import json
import secrets
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.errors import INTERNAL_ERROR, SHUTTING_DOWN, UNAVAILABLE_ERRORS, ValidationError
from serving.triton.abort_channel import ENGINE_MODEL, abort_everywhere
from serving.triton.engine_stream import EngineStream, Interrupted, StreamError, engine_grpc_url
from serving.triton.request_builder import Preprocessor, text_tensor
from serving.triton.request_inputs import triton_parameters
from serving.triton.startup_heap import freeze_startup_heap

# How often each request is checked for cancellation (a round trip to the server each).
POLL_INTERVAL_S = 0.05
# How long finalize() waits for each worker; llm_engine ends the requests still in flight.
FINALIZE_TIMEOUT_S = 30.0


@dataclass(slots=True)
class Relay:
    """One client request and the engine request it became."""

    sender: object  # the client's pb_utils.InferenceResponseSender
    engine_request_id: str  # the Triton request id of the forwarded request; aborts name it
    abort_key: str = field(default_factory=lambda: secrets.token_hex(16))  # and prove they come from here
    stream: EngineStream | None = None  # the engine request's stream, once sent
    next_check: float = 0.0  # time.monotonic() of the next is_cancelled() check
    aborted: bool = False  # an abort went to llm_engine; nothing more is relayed
    finished: bool = False  # the client has had its COMPLETE_FINAL
    # guards the flags; held across is_cancelled() and the final send, so that the sender is
    # never asked about a request that has ended
    lock: threading.Lock = field(default_factory=threading.Lock)


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                "llm must be decoupled: model_transaction_policy { decoupled: true }"
            )
        parameters = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        repository = Path(args["model_repository"]).parent  # args name the model's own directory
        self.preprocessor = Preprocessor.from_parameters(parameters, repository)
        self.input_names = [i["name"] for i in model_config["input"]]
        self.output_names = {o["name"] for o in model_config["output"]}
        self.engine_url = engine_grpc_url(parameters.get("engine_grpc_url", ""))
        # one request at a time: an HF fast tokenizer used from several threads at once may
        # raise "Already borrowed"
        self.preprocess_lock = threading.Lock()
        self.lock = threading.Lock()  # guards relays and workers
        self.relays: dict[str, Relay] = {}  # engine request id -> relay, until its worker ends
        self.workers: set[threading.Thread] = set()
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="llm-watcher", daemon=True)
        self.watcher.start()
        pb_utils.Logger.log_info(
            f"llm: tokenizer {self.preprocessor.tokenizer_dir}, "
            f"max_model_len {self.preprocessor.max_model_len}, forwarding to {ENGINE_MODEL} at {self.engine_url}"
        )
        freeze_startup_heap()

    # -- Triton's thread: hand off, never block ---------------------------------------------------
    def execute(self, requests):
        for request in requests:
            inputs = {}
            for name in self.input_names:
                if name == "abort_key":
                    continue  # a closed stream stops requests here; the engine request has its own key
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy().copy()  # the worker outlives the request
            relay = Relay(request.get_response_sender(), uuid.uuid4().hex)
            try:
                parameters = triton_parameters(request)
            except ValidationError as e:
                self._finish(relay, _error_response(str(e), pb_utils.TritonError.INVALID_ARG))
                continue
            worker = threading.Thread(
                target=self._serve, args=(relay, inputs, parameters), name="llm-worker", daemon=True
            )
            with self.lock:
                self.relays[relay.engine_request_id] = relay
                self.workers.add(worker)
            worker.start()
        return None

    # -- worker thread, one per request -----------------------------------------------------------
    def _serve(self, relay: Relay, inputs: dict[str, np.ndarray], parameters: dict) -> None:
        try:
            self._generate(relay, inputs, parameters)
        except Exception as e:  # the request must still end, or its client waits forever
            detail = "".join(traceback.format_exception(e))
            pb_utils.Logger.log_error(f"llm: request {relay.engine_request_id}: {detail}")
            self._finish(relay, _error_response(INTERNAL_ERROR))
            self._abort(relay)  # the engine request, if any, has no one to relay it now
        finally:
            with self.lock:
                del self.relays[relay.engine_request_id]
                self.workers.discard(threading.current_thread())

    def _generate(self, relay: Relay, inputs: dict[str, np.ndarray], parameters: dict) -> None:
        try:
            with self.preprocess_lock:
                request = self.preprocessor(inputs, parameters)
        except ValidationError as e:
            self._finish(relay, _error_response(str(e), pb_utils.TritonError.INVALID_ARG))
            return
        keep_finish_reason = request.options.return_finish_reason
        request.options.return_finish_reason = True  # a finish reason marks the last response
        self._check_cancelled(relay)
        if relay.aborted:
            self._finish(relay)
            return
        # errors in band: an error on a gRPC stream comes without its Triton code, which the
        # error's text stands for (UNAVAILABLE_ERRORS)
        inputs = request.engine_inputs(in_band_errors=True) | {"abort_key": text_tensor(relay.abort_key)}
        try:
            stream = EngineStream(self.engine_url, ENGINE_MODEL, relay.engine_request_id, inputs)
        except StreamError as e:
            pb_utils.Logger.log_error(f"llm: request {relay.engine_request_id}: {e}")
            self._finish(relay, _error_response(str(e), pb_utils.TritonError.UNAVAILABLE))
            return
        with relay.lock:
            relay.stream = stream
            aborted = relay.aborted  # an abort before this point could not interrupt the stream
        try:
            while not (aborted or stream.finished):
                try:
                    outputs, last = stream.next()
                except Interrupted:  # aborted, or the model is being unloaded
                    break
                except StreamError as e:
                    code = pb_utils.TritonError.UNAVAILABLE if str(e) in UNAVAILABLE_ERRORS else None
                    self._finish(relay, _error_response(str(e), code))
                    break
                self._check_cancelled(relay)
                aborted = relay.aborted
                if not aborted:
                    self._relay(relay, outputs, last, keep_finish_reason)
        finally:
            stream.close()  # cancels the engine request if it has not ended
        if self.stopping.is_set() and not relay.aborted:
            self._finish(relay, _shutting_down())
        self._finish(relay)  # no-op if the engine's last response was relayed

    def _relay(self, relay: Relay, outputs: dict[str, np.ndarray], last: bool, keep_finish_reason: bool) -> None:
        if relay.finished:
            return
        error = _text(outputs, "error")
        if error:
            code = pb_utils.TritonError.UNAVAILABLE if error in UNAVAILABLE_ERRORS else None
            self._finish(relay, _error_response(error, code))
            return
        last = last or _text(outputs, "finish_reason") not in ("", "None")  # "None": not the last yet
        if not keep_finish_reason:
            outputs.pop("finish_reason", None)
        tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items() if name in self.output_names]
        if not tensors:
            if last:
                self._finish(relay)  # the engine's empty final response
            return
        response = pb_utils.InferenceResponse(output_tensors=tensors)
        if last:
            self._finish(relay, response)
        else:
            relay.sender.send(response)

    def _finish(self, relay: Relay, response=None) -> None:
        """Send the client request's one COMPLETE_FINAL (with `response`, if any)."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        with relay.lock:
            if relay.finished:
                return
            relay.finished = True
            if response is None:
                relay.sender.send(flags=final)
            else:
                relay.sender.send(response, flags=final)

    # -- cancellation: worker and watcher threads -------------------------------------------------
    def _watch(self) -> None:
        """Checks requests awaiting a response (a prefill, a queue) for cancellation."""
        while not self.stopping.wait(POLL_INTERVAL_S):
            with self.lock:
                relays = list(self.relays.values())
            for relay in relays:
                try:
                    self._check_cancelled(relay)
                except Exception as e:
                    pb_utils.Logger.log_error(f"llm: watcher: {e!r}")

    def _check_cancelled(self, relay: Relay) -> None:
        now = time.monotonic()
        with relay.lock:
            if relay.aborted or relay.finished or now < relay.next_check:
                return
            relay.next_check = now + POLL_INTERVAL_S
            cancelled = relay.sender.is_cancelled()
        if cancelled:
            self._abort(relay)

    def _abort(self, relay: Relay) -> None:
        """Have llm_engine abort the forwarded request (or, if it has not arrived yet, abort it
        on arrival), and stop the worker's wait for its next response."""
        with relay.lock:
            if relay.aborted:
                return
            relay.aborted = True
            stream = relay.stream
        if stream is not None:
            stream.interrupt()  # the worker stops waiting for the engine's next response
        if not abort_everywhere(ENGINE_MODEL, relay.engine_request_id, relay.abort_key):
            pb_utils.Logger.log_error(f"llm: no {ENGINE_MODEL} instance took the abort of {relay.engine_request_id}")

    def finalize(self):
        """Stop the watcher, wait for the workers; a request still open ends with UNAVAILABLE."""
        self.stopping.set()
        self.watcher.join()
        with self.lock:
            streams = [relay.stream for relay in self.relays.values() if relay.stream is not None]
        for stream in streams:
            stream.interrupt()
        with self.lock:
            workers = list(self.workers)
        for worker in workers:
            worker.join(FINALIZE_TIMEOUT_S)
        with self.lock:
            relays = list(self.relays.values())
        for relay in relays:
            self._finish(relay, _shutting_down())


def _text(outputs: dict[str, np.ndarray], name: str) -> str:
    value = outputs.get(name)
    if value is None or not value.size:
        return ""
    return value.reshape(-1)[0].decode("utf-8")


def _error_response(message: str, code=None):
    code = pb_utils.TritonError.INTERNAL if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _shutting_down():
    return _error_response(SHUTTING_DOWN, pb_utils.TritonError.UNAVAILABLE)
