"""The ranks of a tensor-parallel engine: rank 0 is the engine's own process; ranks 1..N-1 are
worker processes (backend/tp_worker.py) that hold their shard of the model and its KV cache and
run each step's forward when rank 0 broadcasts it.

One message per step: rank 0 broadcasts the pickled StepInput over the process group (gloo here;
NCCL would carry the all-reduces on CUDA), then every rank runs the forward, whose row-parallel
layers all-reduce. The rendezvous is a file unique to this engine, so several engines share a
host. A worker that dies fails rank 0's next collective, or is seen gone before the next step:
FatalEngineError (the engine ends every request and reports dead). Workers exit when rank 0's
process is gone; `close()` stops them and waits, killing any left after a grace period.
"""
from __future__ import annotations

import datetime
import os
import subprocess

import torch
import torch.distributed as dist

from backend.child_process import start_module, unique_path
from backend.config import EngineConfig
from backend.errors import FatalEngineError
from backend.model_runner import ModelRunner, StepInput

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # nothing waits for a dead peer for ever
CLOSE_GRACE_S = 10.0


class TensorParallelGroup:
    def __init__(self, config: EngineConfig):
        self.world_size = config.tensor_parallel_size
        self.rendezvous = unique_path("tp")
        self.workers = [
            start_module("backend.tp_worker", config, "--rank", str(rank), "--rendezvous", self.rendezvous,
                         "--parent", str(os.getpid()))
            for rank in range(1, self.world_size)
        ]
        self.group = _init_group(self.rendezvous, 0, self.world_size)
        self.closed = False

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return all_gather(tensor, self.group)

    def broadcast(self, message: object) -> None:
        """Send every worker one object (a StepInput, the KV pool's size, or None: stop)."""
        self.check_workers()
        try:
            dist.broadcast_object_list([message], src=0, group=self.group)
        except Exception as e:
            raise FatalEngineError(f"a tensor-parallel worker failed: {e}") from e

    def check_workers(self) -> None:
        for rank, worker in enumerate(self.workers, start=1):
            if worker.poll() is not None:
                raise FatalEngineError(f"tensor-parallel worker {rank} exited with code {worker.returncode}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if all(w.poll() is None for w in self.workers):
                dist.broadcast_object_list([None], src=0, group=self.group)
        except Exception:
            pass  # a worker is gone already: the others notice their parent, or are killed below
        for worker in self.workers:
            try:
                worker.wait(CLOSE_GRACE_S)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        dist.destroy_process_group(self.group)
        if os.path.exists(self.rendezvous):
            os.remove(self.rendezvous)


def all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's `tensor` (all of one shape), in rank order."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return gathered


def _init_group(rendezvous: str, rank: int, world_size: int):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    return dist.group.WORLD


class TensorParallelRunner:
    """Rank 0's ModelRunner: each step is broadcast to the workers, then run here too."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup):
        self.runner = runner
        self.group = group

    def __getattr__(self, name: str):  # kv_caches, graphs, ...: the wrapped runner's
        return getattr(self.runner, name)

    def run(self, step: StepInput) -> torch.Tensor:
        self.group.broadcast(step)
        try:
            return self.runner.run(step)
        except RuntimeError as e:  # a collective with a dead peer
            raise FatalEngineError(f"a tensor-parallel collective failed: {e}") from e
