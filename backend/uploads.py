"""Host lists to the device without waiting: one function for every upload on the step path.

A copy from pageable host memory makes CUDA wait for the stream before it starts (the copy is
staged), so a `non_blocking` upload of a plain tensor is a hidden host wait. Every upload goes
through pinned memory instead (PyTorch's caching host allocator keeps each buffer until its copy
has run), so the host never waits for queued device work here.
"""
from __future__ import annotations

import torch


def on_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list (or host tensor) as a tensor on `device`, uploaded without waiting."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host if dtype is None or host.dtype == dtype else host.to(dtype)
    return host.to(dtype or host.dtype).pin_memory().to(device, non_blocking=True)
