"""Which device an engine runs on, and binding it in the thread that launches the work.

CUDA's current device is per thread: `torch.cuda.set_device` in the thread that builds the engine
does nothing for the engine loop's thread (or the engine core's), which would launch every kernel
on GPU 0 for an instance on `cuda:N`. So every thread that steps an engine calls `bind_device`
first (EngineLoop's thread does; the engine core process runs an EngineLoop).
"""
from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """`auto`: the first GPU if there is one, else the CPU; otherwise the device named."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def bind_device(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device (nothing to do on a CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
