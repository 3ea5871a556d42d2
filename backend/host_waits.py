"""The host's waits for the device, counted per step.

Every place on the step path where the host waits for the device goes through `HostWaits.wait`:
the read-back of a step's tokens, the host copy of drafts proposed from tokens still on the
device, the reuse of host staging buffers an upload may still be reading. None calls
`torch.cuda.synchronize` (a wait for everything queued). A wait is counted on every device, so
the waits a step costs on a GPU can be checked on a CPU, where they return at once:

    plain decoding, overlapped steps      1 per step (the tokens of the step before)
    draft speculation, overlapped steps   at most 2 (those, and the drafts' host copy)

Waits are for marks, points in the device's queue taken in order (one stream). Work is done in
queue order, so once the host has waited for a mark, every earlier one is reached too: waiting
for it is free and is not counted (on a GPU, its event would be found complete at once).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

HISTORY = 256  # steps whose counts are kept


@dataclass(frozen=True)
class DeviceMark:
    """A point in the device's queue: the `seq`-th mark taken; on CUDA an event recorded there."""
    seq: int
    event: torch.cuda.Event | None


class HostWaits:
    def __init__(self):
        self.total = 0
        self.this_step = 0
        self.per_step: collections.deque[int] = collections.deque(maxlen=HISTORY)  # newest last
        self._taken = 0  # marks taken
        self._reached = 0  # the latest mark waited for: it and every earlier one are done

    def mark(self, device: torch.device) -> DeviceMark:
        """A mark after the work queued so far (on a CPU that work is done already)."""
        self._taken += 1
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return DeviceMark(self._taken, event)

    def wait(self, mark: DeviceMark) -> None:
        """Wait until the device has reached `mark`; counted unless a later mark was waited for."""
        if mark.seq <= self._reached:
            return
        self.total += 1
        self.this_step += 1
        if mark.event is not None:
            mark.event.synchronize()
        self._reached = mark.seq

    def end_step(self) -> None:
        self.per_step.append(self.this_step)
        self.this_step = 0
