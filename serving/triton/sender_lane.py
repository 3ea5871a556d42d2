"""Sender lanes: the threads that call response_sender.send() for llm_engine.

send() returns only once the server has handed the response to its receiver. A receiver that is
stuck (a BLS caller whose stub process hangs: the server waits, with no timeout, for it to take
each response) makes send() wait for ever. So the sends are spread over a few lanes, each request
always on the same lane (its responses stay in order), and the model replaces a lane whose send
has waited too long: `hand_over()` moves the lane's queued sends to a fresh thread, and the stuck
thread ends when (if ever) its send returns.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

_STOP = object()


@dataclass(slots=True)
class PendingSend:
    state: object  # the request's RequestState (its sender, and `abandoned`: drop its sends)
    response: object | None  # pb_utils.InferenceResponse, or None for flags alone
    flags: int


class SenderLane:
    def __init__(
        self,
        name: str,
        on_error: Callable[[PendingSend, Exception], None],
        on_abandoned: Callable[[PendingSend], None],
    ):
        self.name = name
        self.on_error = on_error  # called on this lane's thread when a send raises
        self.on_abandoned = on_abandoned  # called when a stuck send returns after the hand-over
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # PendingSend or _STOP
        self.lock = threading.Lock()  # guards sending, since and retired
        self.sending: PendingSend | None = None  # the send in progress
        self.since = 0.0  # time.monotonic() when it began
        self.retired = False  # handed over: end after the send in progress
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, item: PendingSend) -> None:
        self.queue.put(item)

    def stuck(self, now: float, timeout: float) -> PendingSend | None:
        """The send in progress, if it has waited longer than `timeout`."""
        with self.lock:
            return self.sending if self.sending is not None and now - self.since > timeout else None

    def hand_over(self) -> SenderLane:
        """A fresh lane holding this lane's queued sends; this lane's thread ends once its send
        returns. Only for a stuck lane (else this lane itself is returned)."""
        with self.lock:
            if self.sending is None:
                return self
            self.retired = True
        fresh = SenderLane(self.name, self.on_error, self.on_abandoned)
        while True:
            try:
                fresh.put(self.queue.get_nowait())
            except queue.Empty:
                return fresh

    def stop(self, timeout: float) -> None:
        self.queue.put(_STOP)
        self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is _STOP:
                return
            if item.state.abandoned:
                continue
            with self.lock:
                self.sending, self.since = item, time.monotonic()
            try:
                if item.response is None:
                    item.state.sender.send(flags=item.flags)
                else:
                    item.state.sender.send(item.response, flags=item.flags)
            except Exception as e:
                self.on_error(item, e)
            with self.lock:
                self.sending = None
                retired = self.retired
            if retired:
                self.on_abandoned(item)
                return
