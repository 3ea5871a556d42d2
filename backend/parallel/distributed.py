"""The ranks of a parallel engine and what travels between them, over torch.distributed:
tensor_parallel_size T ranks per pipeline stage, rank = stage * T + tp_rank. Rank 0 is the engine
(it schedules and samples); every other rank is a worker process (backend/parallel/worker.py).
Each rank runs on its own device (backend/device.py `rank_device`: on CUDA a GPU each).

Two planes, each a set of groups over the same ranks:
    control        gloo, host memory: the config, each step's header (backend/parallel/wire.py),
                   sizes, the forward times
    tensors        NCCL on CUDA (gloo on CPUs), each rank's device: the step's tensors, the
                   all-reduces and gathers of the sharded layers, the pipeline's hidden states and
                   residuals and the logits sent back to rank 0; nothing crosses the host on CUDA

    joined by      a rendezvous: a file in the engine's private directory on one host, or
                   torchrun's MASTER_ADDR:MASTER_PORT when workers on other nodes join
                   (backend/parallel/node.py). Before anything else passes between them, every rank proves
                   it holds the engine's secret (`prove_secret`); on one host, gloo binds loopback
    everyone       a group of all ranks (in each plane): the set-up broadcasts and the pipeline's sends
    stage group    the T ranks of one stage (in each plane): the all-reduces and gathers of its
                   sharded layers, and rank 0's broadcast of each step to stage 0
    pipeline       each rank of stage s sends every step to the same tp_rank of stage s+1: the
                   StepInput (a typed header, backend/parallel/wire.py, then its tensors) and the hidden
                   states and residuals; the last stage's first rank sends the logits back to
                   rank 0. Sends are asynchronous (isend), so a stage never waits for the next
                   one to be ready before taking its next batch.

Only tensors cross between the ranks: a message is msgpack in a uint8 tensor, decoded into the
one type expected there, never run. No collective waits for a dead or silent peer for
ever: a peer that died breaks its connections (an error at once), a silent one times out after
COLLECTIVE_TIMEOUT.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import os
import secrets
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from backend.config import EngineConfig
from backend.device import bind_device, device_of_rank
from backend.model.model_runner import StepInput
from backend.model.tensor_parallel import TensorParallelRank
from backend.parallel import wire
from backend.parallel.wire import StepHeader, WireError

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
JOIN_TIMEOUT = datetime.timedelta(seconds=600)  # ranks on other nodes are started by hand
PROOF_TIMEOUT = JOIN_TIMEOUT  # for every rank's proof, once rank 0 has posted the nonce (workers may still be starting)
RANK_SECRET_VARIABLE = "SPECSERVE_RANK_SECRET"  # hex; the same on every node
MIN_SECRET_BYTES = 16
NONCE_BYTES = 32
# how long a refusing rank 0 keeps its rendezvous open for the other ranks to read the verdict
VERDICT_READ_TIMEOUT = datetime.timedelta(seconds=5)
MAX_MESSAGE_BYTES = 64 * 2**20


class RankRefusedError(RuntimeError):
    """A rank that did not prove it holds the ranks' secret: the join is refused."""


def rank_secret_from_env() -> bytes:
    """The ranks' shared secret, from SPECSERVE_RANK_SECRET (never logged)."""
    text = os.environ.get(RANK_SECRET_VARIABLE, "")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{RANK_SECRET_VARIABLE} must be set, to the same value on every node: a secret of at least "
                         f"{MIN_SECRET_BYTES} bytes in hex, e.g. from `python -c 'import secrets; "
                         f"print(secrets.token_hex(32))'`" + (" (the value set is not one)" if text else ""))
    return secret


@dataclass(slots=True)
class RankGroups:
    rank: int
    world_size: int
    tensor_parallel_size: int
    everyone: dist.ProcessGroup  # control plane (gloo)
    stage_groups: list[dist.ProcessGroup]  # per stage, its T ranks (empty at T = 1)
    device: torch.device  # this rank's
    device_everyone: dist.ProcessGroup  # the tensors' plane (NCCL on CUDA)
    device_stage_groups: list[dist.ProcessGroup]

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
        if not self.device_stage_groups:
            return None
        group = self.device_stage_groups[self.stage]
        return TensorParallelRank(self.tp_rank, self.tensor_parallel_size,
                                  lambda t: dist.all_reduce(t, group=group), lambda t: all_gather(t, group))

    def broadcast_in_stage(self, step: StepInput | None) -> StepInput | None:
        """Stage 0: rank 0's step (None: stop) to its stage's ranks: the header on the control
        plane, its tensors on the tensors' plane (rank 0's on its device already: no wait)."""
        if self.rank == 0:
            header, tensors = StepHeader.of(step, self.device) if step is not None else (None, ())
            broadcast_bytes(wire.encode(header), self.stage_groups[0])
        else:
            header = wire.STEPS.decode(broadcast_bytes(None, self.stage_groups[0]))
            tensors = header.buffers(self.device) if header is not None else ()
        for tensor in tensors:
            dist.broadcast(tensor, 0, group=self.device_stage_groups[0])
        if self.rank == 0:
            return step
        return header.step(tensors) if header is not None else None

    def send_step(self, sends: Sends, step: StepInput | None, tensors: tuple[torch.Tensor, ...], dst: int) -> None:
        """A step (None: stop) and its hidden states and residuals [num_tokens, hidden] to `dst`."""
        header, step_tensors = StepHeader.of(step, self.device) if step is not None else (None, ())
        payload = _payload(wire.encode(header))
        sends.send(torch.tensor([payload.numel()], dtype=torch.int64), dst, self.everyone)
        sends.send(payload, dst, self.everyone)
        for tensor in (*step_tensors, *tensors):
            sends.send(tensor, dst, self.device_everyone)

    def recv_step(self, src: int, hidden_size: int, dtype: torch.dtype
                  ) -> tuple[StepInput | None, tuple[torch.Tensor, ...]]:
        """What `send_step` sent: the step and its (x, residual), on this rank's device, or (None, ()) to stop."""
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src, group=self.everyone)
        payload = torch.empty(_checked_size(size), dtype=torch.uint8)
        dist.recv(payload, src, group=self.everyone)
        header = wire.STEPS.decode(payload.numpy().tobytes())
        if header is None:
            return None, ()
        step_tensors = header.buffers(self.device)
        num_tokens = sum(map(len, header.token_ids))
        tensors = tuple(torch.empty(num_tokens, hidden_size, dtype=dtype, device=self.device) for _ in range(2))
        for tensor in (*step_tensors, *tensors):
            dist.recv(tensor, src, group=self.device_everyone)
        return header.step(step_tensors), tensors

    def broadcast_num_blocks(self, num_blocks: int | None) -> int:
        """Rank 0's KV pool size, on every rank."""
        box = torch.tensor([num_blocks or 0], dtype=torch.int64)
        dist.broadcast(box, 0, group=self.everyone)
        return int(box)


def join(init_method: str, rank: int, world_size: int, secret: bytes, config: EngineConfig | None = None,
         interface: str | None = None) -> tuple[RankGroups, EngineConfig]:
    """Join the ranks (every rank calls this; rank 0 hosts the rendezvous and passes the engine's
    config, which the others receive) and make the groups. Every rank first proves it holds
    `secret`; `interface` (e.g. "lo"): the network interface gloo binds (None: gloo's choice, or
    GLOO_SOCKET_IFNAME)."""
    store = next(dist.rendezvous(init_method, rank, world_size, timeout=JOIN_TIMEOUT))[0]
    store.set_timeout(JOIN_TIMEOUT)
    try:
        prove_secret(dist.PrefixStore("specserve", store), secret, rank, world_size)
    except BaseException as e:
        # Rank 0's store is a server (across nodes, listening on every interface) that lives as long as
        # a reference does: the failed frames' locals are dropped now, not at the next garbage
        # collection, so a refused join leaves no port open
        traceback.clear_frames(e.__traceback__)
        del store
        raise
    with _gloo_interface(interface):
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=JOIN_TIMEOUT)
        try:
            everyone = dist.new_group(list(range(world_size)), timeout=COLLECTIVE_TIMEOUT)
            sent = config.to_json().encode() if config is not None else None
            config = EngineConfig.from_json(broadcast_bytes(sent, everyone).decode())
            t = config.tensor_parallel_size
            if world_size != t * config.pipeline_parallel_size:
                raise ValueError(f"world size {world_size} is not tensor_parallel_size x pipeline_parallel_size "
                                 f"({t} x {config.pipeline_parallel_size})")
            stages = [list(range(s * t, (s + 1) * t)) for s in range(world_size // t)] if t > 1 else []
            stage_groups = [dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT) for ranks in stages]
            device = device_of_rank(config, rank)
            bind_device(device)  # NCCL's communicators are made on the current device
            backend = "nccl" if device.type == "cuda" else "gloo"
            device_everyone = dist.new_group(list(range(world_size)), timeout=COLLECTIVE_TIMEOUT, backend=backend)
            device_stage_groups = [dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT, backend=backend)
                                   for ranks in stages]
        except BaseException:
            dist.destroy_process_group()
            raise
    return RankGroups(rank, world_size, t, everyone, stage_groups, device, device_everyone,
                      device_stage_groups), config


def prove_secret(store: dist.Store, secret: bytes, rank: int, world_size: int) -> None:
    """Every rank proves it holds the ranks' secret before anything else passes between them:
    rank 0 posts a fresh nonce at the rendezvous, every other rank answers
    HMAC-SHA256(secret, nonce || rank), and rank 0 compares each answer with its own in constant
    time, then posts the verdict. A rank that answered wrong, or not within PROOF_TIMEOUT, fails
    the join on every rank (RankRefusedError, naming it). Rank 0 only compares what it is sent; a
    refusing rank 0 waits (up to VERDICT_READ_TIMEOUT) for the others to say they read the verdict,
    since its rendezvous closes when it fails."""
    if rank > 0:
        store.set(f"proof/{rank}", _proof(secret, store.get("nonce"), rank))
        verdict = store.get("verdict").decode(errors="replace")
        if verdict != "ok":
            store.set(f"read/{rank}", b"")
            raise RankRefusedError(f"rank 0 refused the join: {verdict}")
        return
    nonce = secrets.token_bytes(NONCE_BYTES)
    store.set("nonce", nonce)
    deadline = time.monotonic() + PROOF_TIMEOUT.total_seconds()
    refused = [r for r in range(1, world_size) if not _proved(store, _proof(secret, nonce, r), r, deadline)]
    if not refused:
        store.set("verdict", "ok")
        return
    who = f"rank {refused[0]} did not prove it holds" if len(refused) == 1 else \
        f"ranks {', '.join(map(str, refused))} did not prove they hold"
    verdict = f"{who} the ranks' shared secret ({RANK_SECRET_VARIABLE})"
    store.set("verdict", verdict)
    try:
        store.wait([f"read/{r}" for r in range(1, world_size)], VERDICT_READ_TIMEOUT)
    except RuntimeError:  # a rank that never answered, or one that does not follow the protocol
        pass
    raise RankRefusedError(verdict)


def _proof(secret: bytes, nonce: bytes, rank: int) -> bytes:
    return hmac.new(secret, nonce + rank.to_bytes(4, "big"), hashlib.sha256).digest()


def _proved(store: dist.Store, expected: bytes, rank: int, deadline: float) -> bool:
    try:
        store.wait([f"proof/{rank}"], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except RuntimeError:  # no answer in time
        return False
    return hmac.compare_digest(store.get(f"proof/{rank}"), expected)


@contextlib.contextmanager
def _gloo_interface(name: str | None):
    """GLOO_SOCKET_IFNAME = `name` while gloo makes its devices (each group makes its own)."""
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        if name is not None and before is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        elif name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = before


def broadcast_bytes(data: bytes | None, group) -> bytes:
    """Rank 0's `data` (None on the others), on every rank of `group`."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, 0, group=group)
    payload = _payload(data) if data is not None else torch.empty(_checked_size(size), dtype=torch.uint8)
    dist.broadcast(payload, 0, group=group)
    return payload.numpy().tobytes()


def _payload(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _checked_size(size: torch.Tensor) -> int:
    n = int(size)
    if not 0 < n <= MAX_MESSAGE_BYTES:
        raise WireError(f"a message of {n} bytes announced; a message is 1 to {MAX_MESSAGE_BYTES} bytes")
    return n


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


def send_busy(busy: list[tuple[float, float]], group) -> None:
    """A worker's forwards' (start, end) to rank 0, for the pipeline's bubble."""
    times = torch.tensor(busy, dtype=torch.float64).reshape(-1, 2)
    dist.send(torch.tensor([times.shape[0]], dtype=torch.int64), 0, group=group)
    if times.shape[0]:
        dist.send(times, 0, group=group)


def recv_busy(world_size: int, group) -> list[list[tuple[float, float]]]:
    """Rank 0: per rank 1.., what its `send_busy` sent."""
    busy = []
    for rank in range(1, world_size):
        n = torch.empty(1, dtype=torch.int64)
        dist.recv(n, rank, group=group)
        times = torch.empty(int(n), 2, dtype=torch.float64)
        if times.shape[0]:
            dist.recv(times, rank, group=group)
        busy.append([(start, end) for start, end in times.tolist()])
    return busy
