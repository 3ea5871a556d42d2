"""Back-pressure from one engine instance to Triton's queue.

A decoupled model's execute() returns at once, so Triton sees every instance as idle and hands
requests out with no idea of their load. With a limit, execute() returns only once this instance
has at most `limit` requests taken but not started (no first output yet): until then Triton keeps
the next requests in its own queue, hands them to an instance with room, and applies the model's
queue policy (max_queue_size, timeouts) to them. Limit 0: execute() never waits.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

WAKE_S = 0.1  # how often a waiting execute() checks `give_up`


class AdmissionGate:
    def __init__(self, limit: int):
        self.limit = limit
        self.not_started = 0
        self.changed = threading.Condition()

    def taken(self) -> None:
        with self.changed:
            self.not_started += 1

    def started(self) -> None:
        """A request taken has its first output (or ended)."""
        with self.changed:
            self.not_started -= 1
            self.changed.notify_all()

    def wait_for_room(self, give_up: Callable[[], bool]) -> None:
        """Return once at most `limit` requests wait to start, or when `give_up()` says so."""
        if not self.limit:
            return
        with self.changed:
            while self.not_started > self.limit and not give_up():
                self.changed.wait(WAKE_S)
