"""EngineLoop's interface with the engine in a process of its own (engine_core.py).

The serving adapter's threads (Triton's execute thread, the sender) then never compete with the
engine for one GIL. `submit` validates at once against the limits the core reported when it
started (a bad request is refused here, as in-process), then sends the request; a receiver
thread hands each output to its callback; a message on the outputs socket that is not one the
core sends (backend/process/core_messages.py) is logged and dropped. The sockets live in a directory only
this user can enter, removed at shutdown. If the core process dies, every request in flight ends
with ENGINE_DEAD within RECEIVE_POLL_S and `dead` is set; `shutdown` stops it and waits for it
(killing it after a grace period), so no process outlives the client.
"""
from __future__ import annotations

import logging
import os
import subprocess
import threading

import zmq

from backend.child_process import private_directory, remove_directory, start_module
from backend.config import EngineConfig
from backend.core.grammar_compiler import GrammarCompiler
from backend.core.request_limits import RequestLimits
from backend.engine_driver import OutputCallback
from backend.errors import ENGINE_DEAD, EngineDeadError
from backend.outputs import EngineStats, RequestOutput
from backend.parallel import wire
from backend.process import core_messages
from backend.process.core_messages import (
    AbortRequest,
    AddRequest,
    Dead,
    Failed,
    Output,
    Ready,
    Stats,
    StopRequest,
)
from backend.sampling_params import SamplingParams

log = logging.getLogger(__name__)
RECEIVE_POLL_S = 0.2
STARTUP_TIMEOUT_S = 600.0  # building the engine loads weights and may tune kernels
SHUTDOWN_GRACE_S = 30.0


class EngineCoreClient:
    """An EngineDriver (backend/engine_driver.py) over an engine core in its own process. It
    validates requests here, with the limits the core reported at start-up, and serves the
    counters of the core's last report."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.context = zmq.Context()
        self.directory = private_directory("core")
        requests, outputs = f"ipc://{self.directory}/requests", f"ipc://{self.directory}/outputs"
        self.requests = self.context.socket(zmq.PUSH)
        self.requests.bind(requests)
        self.outputs = self.context.socket(zmq.PULL)
        self.outputs.bind(outputs)
        self._send_lock = threading.Lock()  # execute()'s thread submits, the sender thread aborts
        self._callbacks: dict[str, OutputCallback] = {}
        self._callbacks_lock = threading.Lock()
        self._next_id = 0
        self._stopping = False
        self.dead = False
        self.process = start_module("backend.process.engine_core", "--config", config.to_json(), "--requests", requests,
                                    "--outputs", outputs, "--parent", str(os.getpid()))
        try:
            self.limits, self._stats = self._wait_ready()
            self.max_model_len = self.limits.max_model_len
            self.grammars = GrammarCompiler(config.tokenizer, self.limits.vocab_size, self.limits.eos_token_ids)
        except BaseException:
            self.context.destroy(linger=0)
            remove_directory(self.directory)
            raise
        self._receiver = threading.Thread(target=self._receive, name="specserve-core-receiver", daemon=True)

    def _wait_ready(self) -> tuple[RequestLimits, EngineStats]:
        waited = 0.0
        while waited < STARTUP_TIMEOUT_S:
            message = self._poll()
            if isinstance(message, Ready):
                return message.limits, message.stats
            if isinstance(message, Failed):
                self._stop_process()
                raise RuntimeError(f"the engine core failed to start: {message.message}")
            if self.process.poll() is not None:
                raise RuntimeError(f"the engine core exited with code {self.process.returncode} while starting")
            waited += RECEIVE_POLL_S
        self._stop_process()
        raise RuntimeError(f"the engine core did not start within {STARTUP_TIMEOUT_S:.0f} s")

    # -- EngineDriver ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self._stats

    def start(self) -> None:
        self._receiver.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output: OutputCallback,
               request_id: str | None = None) -> str:
        if self.dead:
            raise EngineDeadError(ENGINE_DEAD)
        self.limits.validate(prompt_ids, params, self.grammars)  # a bad constraint is refused here, as in-process
        with self._callbacks_lock:
            if request_id is None:
                request_id = f"core-{self._next_id}"
                self._next_id += 1
            self._callbacks[request_id] = on_output
        self._send(AddRequest(request_id, list(prompt_ids), params))
        return request_id

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def shutdown(self, timeout: float = SHUTDOWN_GRACE_S) -> None:
        """Stop the core (each request in flight gets its final output first) and wait for it."""
        self._stopping = True
        if self.process.poll() is None:
            self._send(StopRequest())
        self._stop_process(timeout)
        if self._receiver.is_alive():
            self._receiver.join(timeout)
        self._fail_all()  # whatever the core could not end
        self.context.destroy(linger=0)
        remove_directory(self.directory)

    # -- internals ------------------------------------------------------------------------------
    def _send(self, message: AddRequest | AbortRequest | StopRequest) -> None:
        with self._send_lock:
            self.requests.send(wire.encode(message))

    def _poll(self) -> Ready | Failed | Output | Stats | Dead | None:
        """The core's next message, or None when none came within RECEIVE_POLL_S (or it was not one)."""
        if not self.outputs.poll(int(RECEIVE_POLL_S * 1000)):
            return None
        try:
            return core_messages.OUTPUTS.decode(self.outputs.recv())
        except wire.WireError as e:
            log.error("dropped a message on the outputs socket: %s", e)
            return None

    def _stop_process(self, timeout: float = SHUTDOWN_GRACE_S) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the engine core did not stop within %.0f s: killing it", timeout)
            self.process.kill()
            self.process.wait()

    def _receive(self) -> None:
        while True:
            message = self._poll()
            if message is None and self.process.poll() is not None:  # gone: stopped, or died
                if not self._stopping:
                    log.error("the engine core exited with code %s", self.process.returncode)
                self.dead = True
                self._fail_all()
                return
            if isinstance(message, Output):
                self._deliver(message.output)
            elif isinstance(message, Stats):
                self._stats = message.stats
            elif isinstance(message, Dead):
                self.dead = True

    def _deliver(self, output: RequestOutput) -> None:
        with self._callbacks_lock:
            callback = self._callbacks.pop(output.request_id, None) if output.finished else \
                self._callbacks.get(output.request_id)
        if callback is None:
            return
        try:
            callback(output)
        except Exception:  # a broken consumer must not stop the others' outputs
            log.exception("output callback for %s failed", output.request_id)

    def _fail_all(self) -> None:
        with self._callbacks_lock:
            pending, self._callbacks = self._callbacks, {}
        for request_id, callback in pending.items():
            try:
                callback(RequestOutput(request_id, "", [], True, "error", error=ENGINE_DEAD))
            except Exception:
                log.exception("output callback for %s failed", request_id)
