"""Which device an engine (and each of its parallel ranks) runs on, and binding it in the thread
that launches the work.

CUDA's current device is per thread: `torch.cuda.set_device` in the thread that builds the engine
does nothing for the engine loop's thread (or the engine core's), which would launch every kernel
on GPU 0 for an instance on `cuda:N`. So every thread that steps an engine calls `bind_device`
first (EngineLoop's thread does; the engine core process runs an EngineLoop).
"""
from __future__ import annotations

import torch

from backend.config import EngineConfig, parse_gpu_ids
from backend.errors import ValidationError


def resolve_device(name: str) -> torch.device:
    """`auto`: the first GPU if there is one, else the CPU; otherwise the device named."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def bind_device(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device (nothing to do on a CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def rank_device(device: torch.device, rank: int, ranks_per_node: int, gpu_device_ids: tuple[int, ...] = ()
                ) -> torch.device:
    """The device of rank `rank` of a parallel engine whose rank 0 runs on `device`. On a CPU every
    rank's is the CPU. On CUDA each rank has a GPU of its own, picked by its index on its node,
    local = rank % ranks_per_node (torchrun's LOCAL_RANK): on the first node the local-th of
    `gpu_device_ids` (the instance's GPUs, TensorRT-LLM's convention), or without them the GPUs
    from rank 0's on (cuda:N, cuda:N+1, ...); on the other nodes GPU `local` of those the node
    shows (CUDA_VISIBLE_DEVICES there picks them)."""
    if device.type != "cuda":
        return device
    local = rank % ranks_per_node
    if rank >= ranks_per_node:
        return torch.device("cuda", local)
    if gpu_device_ids:
        return torch.device("cuda", gpu_device_ids[local])
    return torch.device("cuda", (device.index or 0) + local)


def device_of_rank(config: EngineConfig, rank: int) -> torch.device:
    """`rank_device` for an engine's config (rank 0: the engine itself)."""
    world_size = config.tensor_parallel_size * config.pipeline_parallel_size
    return rank_device(resolve_device(config.device), rank, world_size // config.nnodes,
                       parse_gpu_ids(config.gpu_device_ids))


def check_gpus(config: EngineConfig) -> None:
    """Every rank this node runs has its GPU here; else a ValidationError naming what asks for more."""
    ranks_here = config.tensor_parallel_size * config.pipeline_parallel_size // config.nnodes
    wanted = [device_of_rank(config, rank).index for rank in range(ranks_here)]
    present = torch.cuda.device_count()
    if max(wanted) >= present:
        name = "gpu_device_ids" if config.gpu_device_ids else "device" if ranks_here == 1 else "tensor_parallel_size"
        raise ValidationError(name, f"the {ranks_here} rank(s) on this node need GPUs {wanted}; "
                              f"this host has {present} (cuda:0..{present - 1})")
