"""Device tensors on their way to the host, copied without waiting for the device's queue."""
from __future__ import annotations

import torch

from backend.host_waits import HostWaits


class HostCopy:
    """Started at once (into pinned memory on CUDA); `wait()` waits for these copies only, not
    for the work queued after them, once (counted by `waits`)."""

    def __init__(self, *tensors: torch.Tensor, waits: HostWaits):
        self.waits = waits
        self.host = list(tensors)
        device = tensors[0].device if tensors else torch.device("cpu")
        if device.type == "cuda":
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                         for t in tensors]
        self.ready = waits.mark(device)
        self.landed = False
        self._values: list[list] | None = None

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, once the copies have landed."""
        if not self.landed:
            self.waits.wait(self.ready)
            self.landed = True
        return self.host

    def values(self) -> list[list]:
        """Each tensor as (nested) Python lists."""
        if self._values is None:
            self._values = [t.tolist() for t in self.wait()]
        return self._values
