"""A device tensor on its way to the host, copied without waiting for the device's queue."""
from __future__ import annotations

import torch


class HostCopy:
    """Started at once (into pinned memory on CUDA); `values()` waits for this copy only, not for
    the work queued after it."""

    def __init__(self, tensor: torch.Tensor):
        self.ready: torch.cuda.Event | None = None
        if tensor.is_cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host = tensor
        self._values: list | None = None

    def values(self) -> list:
        if self._values is None:
            if self.ready is not None:
                self.ready.synchronize()
            self._values = self.host.tolist()
        return self._values
