"""Rank 0's side of a parallel engine (backend/parallel/distributed.py): it starts the worker ranks of its
own node, joins them and the ranks of other nodes (each must prove it holds the ranks' secret:
on one node a fresh one, handed to the workers in their environment; across nodes the operator's
SPECSERVE_RANK_SECRET), sends them the engine's config and the KV pool's size, then drives each
step:

    tensor parallel      TensorParallelExecutor.run: broadcast the step to stage 0, run rank 0's
                         share of it, return the logits
    pipeline parallel    PipelineExecutor.launch: the same for stage 0's layers, then send the hidden
                         states on to stage 1 and return at once; PipelineExecutor.collect: the logits
                         of the oldest step launched, from the last stage, in launch order

A worker of this node that dies is seen before the next step; any dead peer fails rank 0's next
collective or receive: FatalEngineError (the engine ends every request and reports dead).
`close()` stops every rank and waits for this node's workers, killing any left after a grace
period; the ranks' forward times come back to `stage_busy` (the pipeline's bubble).
"""
from __future__ import annotations

import collections
import os
import secrets
import subprocess

import torch
import torch.distributed as dist

from backend.child_process import private_directory, remove_directory, start_module
from backend.config import EngineConfig
from backend.errors import FatalEngineError
from backend.model.model_runner import ModelRunner, StepInput
from backend.model.tensor_parallel import TensorParallelRank
from backend.parallel.distributed import (
    RANK_SECRET_VARIABLE,
    RankGroups,
    RankRefusedError,
    Sends,
    join,
    rank_secret_from_env,
    recv_busy,
)

CLOSE_GRACE_S = 10.0


def start_worker(rank: int, world_size: int, init_method: str, parent: int, env: dict[str, str] | None = None
                 ) -> subprocess.Popen:
    """One worker rank's process (backend/parallel/worker.py), which exits when `parent` is gone; `env`
    holds what it must not get on its command line (the ranks' secret)."""
    return start_module("backend.parallel.worker", "--rank", str(rank), "--world-size", str(world_size),
                        "--init-method", init_method, "--parent", str(parent), env=env)


class WorkerGroup:
    def __init__(self, config: EngineConfig):
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        ranks_per_node = self.world_size // config.nnodes
        secret, interface, init_method = self._rendezvous(config)
        env = {RANK_SECRET_VARIABLE: secret.hex()} | ({"GLOO_SOCKET_IFNAME": interface} if interface else {})
        self.workers = [start_worker(rank, self.world_size, init_method, os.getpid(), env)
                        for rank in range(1, ranks_per_node)]
        self.closed = False
        self.vocab_size = 0  # the logits' width (setup)
        self.stage_busy: list[list[tuple[float, float]]] = []  # per rank 1.., its forwards' (start, end)
        try:
            self.groups: RankGroups = join(init_method, 0, self.world_size, secret, config, interface)[0]
        except Exception as e:
            self._stop_workers(grace_s=0)
            remove_directory(self.directory)
            hint = (" (is `python -m backend.parallel.node` running on every other node?)"
                    if config.nnodes > 1 and not isinstance(e, RankRefusedError) else "")
            raise FatalEngineError(f"the {self.world_size} ranks did not join at {init_method}{hint}: {e}") from e
        self.sends = Sends()
        self.logits_in_flight: collections.deque[int] = collections.deque()  # per step sent on, oldest first

    def _rendezvous(self, config: EngineConfig) -> tuple[bytes, str | None, str]:
        """The ranks' secret, the interface gloo binds (None: gloo's choice) and where the ranks
        meet: across nodes, the operator's secret and MASTER_PORT on this node, which the others
        must reach; on one node, a fresh secret, loopback and a file in a private directory."""
        self.directory: str | None = None
        if config.nnodes > 1:
            try:
                return rank_secret_from_env(), None, f"tcp://127.0.0.1:{config.master_port}"
            except ValueError as e:
                raise FatalEngineError(f"a world of {config.nnodes} nodes needs the ranks' secret: {e}") from None
        self.directory = private_directory("ranks")
        return secrets.token_bytes(32), "lo", f"file://{self.directory}/rendezvous"

    @property
    def tensor_parallel(self) -> TensorParallelRank | None:
        return self.groups.tensor_parallel()

    def setup(self, num_blocks: int, vocab_size: int) -> None:
        """Every rank's KV pool has the same blocks (of its own layers and heads)."""
        self.vocab_size = vocab_size
        self.check_workers()
        self.groups.broadcast_num_blocks(num_blocks)

    def broadcast(self, step: StepInput | None) -> None:
        """Stage 0's other ranks run this step (None: stop)."""
        self.check_workers()
        if self.groups.stage_groups:
            self.groups.broadcast_in_stage(step)

    def send_to_next_stage(self, step: StepInput | None, intermediate: tuple[torch.Tensor, ...]) -> None:
        self.groups.send_step(self.sends, step, intermediate, self.groups.stage_rank(1))
        if step is not None:
            self.logits_in_flight.append(sum(step.num_logits))

    def recv_logits(self) -> torch.Tensor:  # [num_logits, vocab] float32
        """The logits of the oldest step sent on, from the last stage."""
        logits = torch.empty(self.logits_in_flight.popleft(), self.vocab_size, dtype=torch.float32,
                             device=self.groups.device)
        if not logits.shape[0]:  # a step of prompt chunks only: nothing was sent
            return logits
        last_stage = (self.groups.num_stages - 1) * self.groups.tensor_parallel_size
        dist.recv(logits, last_stage, group=self.groups.device_everyone)
        return logits

    def check_workers(self) -> None:
        for rank, worker in enumerate(self.workers, start=1):
            if worker.poll() is not None:
                raise FatalEngineError(f"worker rank {rank} exited with code {worker.returncode}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.check_workers()
            self.broadcast(None)
            if self.groups.num_stages > 1:
                self.send_to_next_stage(None, ())
                while self.logits_in_flight:  # the last stage's sends complete once received
                    self.recv_logits()
            self.sends.wait()
            self.stage_busy = recv_busy(self.world_size, self.groups.everyone)
        except Exception:
            pass  # a rank is gone already: the others notice their peer or their parent, or are killed below
        self._stop_workers(CLOSE_GRACE_S)
        dist.destroy_process_group()
        remove_directory(self.directory)

    def _stop_workers(self, grace_s: float) -> None:
        for worker in self.workers:
            try:
                worker.wait(grace_s)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


class _RankZeroExecutor:
    """What both executors hand to rank 0's own runner (`runner`, where its KV caches and graphs
    are): graph capture, compilation and their counters."""

    def __init__(self, runner: ModelRunner, group: WorkerGroup):
        self.runner = runner  # rank 0's
        self.group = group

    @property
    def graph_replays(self) -> int:
        return self.runner.graph_replays

    def capture_graphs(self, max_batch_size: int, max_model_len: int, query_lens: tuple[int, ...] = (1,)) -> None:
        self.runner.capture_graphs(max_batch_size, max_model_len, query_lens)

    def compile_decode(self) -> None:
        self.runner.compile_decode()

    def compile_prefill(self) -> None:
        self.runner.compile_prefill()


class TensorParallelExecutor(_RankZeroExecutor):
    """Rank 0's ModelRunner under tensor parallelism alone: each step is broadcast to the
    workers, then run here too."""

    def run(self, step: StepInput) -> torch.Tensor:
        try:
            self.group.broadcast(step)
            return self.runner.run(step)
        except RuntimeError as e:  # a collective with a dead peer
            raise FatalEngineError(f"a tensor-parallel collective failed: {e}") from e

    def launch(self, step: StepInput) -> None:
        self.runner.launched.append(self.run(step))

    def collect(self) -> torch.Tensor:  # [num_logits, vocab] float32
        return self.runner.collect()


class PipelineExecutor(_RankZeroExecutor):
    """Rank 0's ModelRunner as pipeline stage 0: `launch` runs a step's first layers and sends it
    on; `collect` returns the logits of the oldest step launched. Any fault between them leaves
    the stages out of step with rank 0: it is fatal."""

    def launch(self, step: StepInput) -> None:
        try:
            self.group.broadcast(step)
            self.group.send_to_next_stage(step, self.runner.run(step))
        except Exception as e:
            raise FatalEngineError(f"a pipeline stage failed: {e}") from e

    def collect(self) -> torch.Tensor:  # [num_logits, vocab] float32
        try:
            return self.group.recv_logits()
        except Exception as e:
            raise FatalEngineError(f"a pipeline stage failed: {e}") from e
