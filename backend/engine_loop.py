"""Drives an LLMEngine from one background thread.

Other threads submit and abort; the engine thread applies those between iterations, steps the
engine while it has work, and hands every RequestOutput to the callback given at submit time.

A server builds its engine on the engine thread too (`EngineLoop.build`): the CPU's OpenMP runtime
keeps a pool of worker threads for every thread that has run a parallel torch operation, and once
its pools hold more threads than the machine has cores it stops letting idle workers spin. An
engine loaded on one thread and stepped on another left two pools behind, and every parallel
operation of every step then waited for a sleeping worker to wake: the default model's batch-1
step took 26.5 ms at 2 threads where the same step on the thread that built it took 9.3.

An idle engine that receives a request can wait a little for more (`batch_wait_ms`): while
requests keep arriving, each within batch_wait_ms of the last, for at most BATCH_WAITS times that
in all, or until they fill a step's budget. A burst of requests then prefills in one step where
the first would otherwise start a step alone and the others wait for it to end; where the server's
other processes share the engine's cores (a CPU), the wait also leaves those cores to the requests
still on their way through them. A lone request pays one batch_wait_ms.

Faults: the engine fails a request alone when the fault is its own (a request's rows that cannot
be built, its grammar or its detokenizer: sampling_metadata.py, output_processor.py). If a
step raises anyway, every request in flight ends with INTERNAL_ERROR and the loop keeps serving;
if the error is fatal (a CUDA error: the device's state is lost), every request ends with
ENGINE_DEAD, the loop is `dead` and refuses new requests at once (EngineDeadError).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from typing import Callable

from backend.device import bind_device
from backend.engine import LLMEngine
from backend.engine_driver import OutputCallback
from backend.errors import (
    ENGINE_DEAD,
    INTERNAL_ERROR,
    EngineDeadError,
    ValidationError,
    is_fatal,
)
from backend.outputs import EngineStats, RequestOutput
from backend.sampling_params import SamplingParams

log = logging.getLogger(__name__)
BATCH_WAITS = 8  # an idle engine's wait for a burst: at most this many times batch_wait_ms


class EngineLoop:
    """An EngineDriver (backend/engine_driver.py) over an LLMEngine on a thread of this process."""

    def __init__(self, engine: LLMEngine | None):
        self.engine = engine  # None only until build() has built it
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._lock = threading.Lock()
        self._next_id = 0
        self.dead = False  # a fatal fault: the engine takes no more requests

    @classmethod
    def build(cls, make_engine: Callable[[], LLMEngine]) -> EngineLoop:
        """A started loop whose engine `make_engine` built on the engine thread itself; what the
        build raised is raised here."""
        loop = cls(None)
        built = threading.Event()
        failure: list[BaseException] = []

        def build_and_run() -> None:
            try:
                loop.engine = make_engine()
            except BaseException as e:  # handed to the caller, which fails the load with it
                failure.append(e)
                return
            finally:
                built.set()
            loop._run()

        loop._thread = threading.Thread(target=build_and_run, name="specserve-engine", daemon=True)
        loop._thread.start()
        built.wait()
        if failure:
            raise failure[0]
        return loop

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def start(self) -> None:
        """Starts the engine thread (a loop from `build` runs already)."""
        if self._thread.ident is None:
            self._thread.start()

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_output: OutputCallback,
        request_id: str | None = None,
    ) -> str:
        """Validate now (raises ValidationError, or EngineDeadError), run on the engine thread."""
        if self.dead:
            raise EngineDeadError(ENGINE_DEAD)
        self.engine.validate(prompt_ids, params)
        with self._lock:
            if request_id is None:
                request_id = f"loop-{self._next_id}"
                self._next_id += 1
        self.add(request_id, prompt_ids, params, on_output)
        return request_id

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, on_output: OutputCallback) -> None:
        """Hand a request to the engine thread unchecked: a bad one ends with an error output."""
        self._inbox.put(("add", request_id, list(prompt_ids), params, on_output))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the thread."""
        self._stopping = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.close()

    def _deliver(self, output: RequestOutput) -> None:
        callback = self._callbacks.get(output.request_id)
        if callback is None:
            return
        if output.finished:
            del self._callbacks[output.request_id]
        try:
            callback(output)
        except Exception:  # a broken consumer must not stop the engine
            log.exception("output callback for %s failed", output.request_id)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                _, request_id, prompt_ids, params, on_output = item
                self._callbacks[request_id] = on_output
                try:  # an error ends just this request
                    if self.dead:
                        raise EngineDeadError(ENGINE_DEAD)
                    self.engine.add_request(prompt_ids, params, request_id)
                except (ValidationError, EngineDeadError) as e:  # e.g. a duplicate id
                    self._deliver(RequestOutput(request_id, "", [], True, "error", error=str(e)))
                except Exception:
                    log.exception("adding request %s failed", request_id)
                    self._deliver(RequestOutput(request_id, "", [], True, "error", error=INTERNAL_ERROR))
            else:
                output = self.engine.abort(item[1])
                if output is not None:
                    self._deliver(output)

    def _gather(self) -> None:
        """An idle engine's first requests are here: take more while they keep arriving, each
        within batch_wait_ms of the last, for at most BATCH_WAITS x batch_wait_ms, or until
        they fill a step (max_num_seqs requests or max_num_batched_tokens prompt tokens)."""
        config = self.engine.config
        gap = config.batch_wait_ms / 1e3
        deadline = time.monotonic() + BATCH_WAITS * gap
        while (len(self.engine.requests) < config.max_num_seqs and not self._stopping
               and sum(r.num_prompt_tokens for r in self.engine.requests.values()) < config.max_num_batched_tokens):
            timeout = min(gap, deadline - time.monotonic())
            self._wakeup.clear()  # (an item put before this is found by empty(); one after sets it again)
            if timeout <= 0 or (self._inbox.empty() and not self._wakeup.wait(timeout)):
                return
            self._drain_inbox()

    def _run(self) -> None:
        bind_device(self.engine.device)  # CUDA's current device is per thread
        idle = True
        while True:
            self._drain_inbox()
            if self._stopping:
                for request_id in list(self.engine.requests):
                    self._deliver(self.engine.abort(request_id))
                return
            if self.dead or not self.engine.has_unfinished_requests():
                idle = True
                self._wakeup.wait(0.1)
                self._wakeup.clear()
                continue
            if idle and self.engine.config.batch_wait_ms > 0:
                self._gather()
            idle = False
            try:
                outputs = self.engine.step()
            except Exception as e:
                self.dead = is_fatal(e)
                log.error("engine step failed%s:\n%s", " fatally" if self.dead else "", traceback.format_exc())
                outputs = self.engine.fail_all(ENGINE_DEAD if self.dead else INTERNAL_ERROR)
            for output in outputs:
                self._deliver(output)
