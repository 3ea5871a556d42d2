"""Stop requests that found nothing to stop, remembered for a while.

A stop can overtake the request it names (the two travel through tritonserver separately), so a
stop that matched nothing in flight is remembered for MEMORY_S, and a request arriving with that id
and the same abort key is ended on arrival. Memory is bounded and every operation is O(1): at most
CAPACITY stops are kept, the oldest forgotten first, so a flood of stops for made-up ids costs the
flooder's own entries and nothing else (a stop without the request's key matches nothing anyway).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

MEMORY_S = 10.0
CAPACITY = 4096


class EarlyAborts:
    def __init__(self, memory_s: float = MEMORY_S, capacity: int = CAPACITY):
        self.memory_s, self.capacity = memory_s, capacity
        # (Triton request id, abort key digest) -> time.monotonic() until which it is remembered
        self.until: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self.lock = threading.Lock()

    def remember(self, triton_request_id: str, digest: bytes) -> None:
        now = time.monotonic()
        with self.lock:
            key = (triton_request_id, digest)
            self.until.pop(key, None)
            self.until[key] = now + self.memory_s
            while len(self.until) > self.capacity or next(iter(self.until.values())) <= now:
                self.until.popitem(last=False)  # insertion order is expiry order

    def take(self, triton_request_id: str, digest: bytes, now: float) -> bool:
        """Whether a stop for this request (id and key) came before it, still remembered at `now`."""
        with self.lock:
            return self.until.pop((triton_request_id, digest), 0.0) > now

    def __len__(self) -> int:
        return len(self.until)
