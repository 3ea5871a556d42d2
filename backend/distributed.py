"""The ranks of a parallel engine and what travels between them, over torch.distributed (gloo on
CPUs): tensor_parallel_size T ranks per pipeline stage, rank = stage * T + tp_rank. Rank 0 is the
engine (it schedules and samples); every other rank is a worker process (backend/worker.py).

    joined by      a rendezvous: a file unique to the engine on one host, or torchrun's
                   MASTER_ADDR:MASTER_PORT when workers on other nodes join (backend/node.py)
    everyone       a group of all ranks: the set-up broadcasts and the pipeline's sends
    stage group    the T ranks of one stage: the all-reduces and gathers of its sharded layers,
                   and rank 0's broadcast of each step to stage 0
    pipeline       each rank of stage s sends every step to the same tp_rank of stage s+1: the
                   StepInput (pickled) and the hidden states and residuals; the last stage's first
                   rank sends the logits back to rank 0. Sends are asynchronous (isend), so a stage
                   never waits for the next one to be ready before taking its next batch.

No collective waits for a dead or silent peer for ever: a peer that died breaks its connections
(an error at once), a silent one times out after COLLECTIVE_TIMEOUT.
"""
from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from backend.config import EngineConfig
from backend.tensor_parallel import TensorParallelRank

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
JOIN_TIMEOUT = datetime.timedelta(seconds=600)  # ranks on other nodes are started by hand


@dataclass(slots=True)
class RankGroups:
    rank: int
    world_size: int
    tensor_parallel_size: int
    everyone: dist.ProcessGroup
    stage_groups: list[dist.ProcessGroup]  # per stage, its T ranks (empty at T = 1)

    @property
    def num_stages(self) -> int:
        return self.world_size // self.tensor_parallel_size

    @property
    def stage(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    def stage_rank(self, stage: int) -> int:
        """This rank's counterpart (same tp_rank) in another stage."""
        return stage * self.tensor_parallel_size + self.tp_rank

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        return self.stage_groups[self.stage] if self.stage_groups else None

    def tensor_parallel(self) -> TensorParallelRank | None:
        """The collectives of this rank's sharded layers (None without tensor parallelism)."""
        group = self.stage_group
        if group is None:
            return None
        return TensorParallelRank(self.tp_rank, self.tensor_parallel_size,
                                  lambda t: dist.all_reduce(t, group=group), lambda t: all_gather(t, group))

    def broadcast_in_stage(self, message: object) -> object:
        """Stage 0: rank 0's message to its stage's ranks."""
        return broadcast(message, self.stage_groups[0])

    def broadcast_to_everyone(self, message: object) -> object:
        return broadcast(message, self.everyone)


def join(init_method: str, rank: int, world_size: int, config: EngineConfig | None = None
         ) -> tuple[RankGroups, EngineConfig]:
    """Join the ranks (every rank calls this; rank 0 hosts the rendezvous and passes the engine's
    config, which the others receive) and make the groups."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=JOIN_TIMEOUT)
    everyone = dist.new_group(list(range(world_size)), timeout=COLLECTIVE_TIMEOUT)
    config = EngineConfig.from_json(broadcast(config.to_json() if config is not None else None, everyone))
    t = config.tensor_parallel_size
    if world_size != t * config.pipeline_parallel_size:
        raise ValueError(f"world size {world_size} is not tensor_parallel_size x pipeline_parallel_size "
                         f"({t} x {config.pipeline_parallel_size})")
    stage_groups = [dist.new_group(list(range(s * t, (s + 1) * t)), timeout=COLLECTIVE_TIMEOUT)
                    for s in range(world_size // t)] if t > 1 else []
    return RankGroups(rank, world_size, t, everyone, stage_groups), config


def broadcast(message: object, group) -> object:
    """Rank 0's `message` (picklable), on every rank of `group`."""
    box = [message]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's `tensor` (all of one shape), in rank order."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return gathered


class Sends:
    """Asynchronous sends not yet known to be done; their tensors stay alive until they are."""

    def __init__(self):
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        self.pending.append((dist.isend(tensor.contiguous(), dst, group=group), tensor))

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []


def send_step(sends: Sends, step: object, tensors: tuple[torch.Tensor, ...], dst: int, group) -> None:
    """A step (None: stop) and its hidden states and residuals [num_tokens, hidden] to `dst`."""
    payload = torch.frombuffer(bytearray(pickle.dumps(step)), dtype=torch.uint8)
    sends.send(torch.tensor([payload.numel()], dtype=torch.int64), dst, group)
    sends.send(payload, dst, group)
    for tensor in tensors:
        sends.send(tensor, dst, group)


def recv_step(src: int, group, hidden_size: int, dtype: torch.dtype) -> tuple[object, tuple[torch.Tensor, ...]]:
    """What `send_step` sent: the step and its (x, residual), or (None, ()) to stop."""
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(payload, src, group=group)
    step = pickle.loads(payload.numpy().tobytes())
    if step is None:
        return None, ()
    num_tokens = sum(map(len, step.token_ids))
    tensors = tuple(torch.empty(num_tokens, hidden_size, dtype=dtype) for _ in range(2))
    for tensor in tensors:
        dist.recv(tensor, src, group=group)
    return step, tensors
