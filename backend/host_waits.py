"""The host's waits for the device, counted per step.

Every place on the step path where the host waits for the device goes through `HostWaits.wait`:
the read-back of a step's tokens, the host copy of drafts proposed from tokens still on the
device, a graph upload that must wait for the last one to have read its buffers. None calls
`torch.cuda.synchronize` (a wait for everything queued). A wait is counted on every device, so
the waits a step costs on a GPU can be checked on a CPU, where they return at once:

    plain decoding, overlapped steps      1 per step (the tokens of the step before)
    draft speculation, overlapped steps   at most 2 (those, and the drafts' host copy)
"""
from __future__ import annotations

import collections

import torch

HISTORY = 256  # steps whose counts are kept


class HostWaits:
    def __init__(self):
        self.total = 0
        self.this_step = 0
        self.per_step: collections.deque[int] = collections.deque(maxlen=HISTORY)  # newest last

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Wait for `event` (None: work that is already on the host, as on a CPU); counted."""
        self.total += 1
        self.this_step += 1
        if event is not None:
            event.synchronize()

    def end_step(self) -> None:
        self.per_step.append(self.this_step)
        self.this_step = 0
