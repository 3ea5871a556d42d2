"""Tensor parallelism on CUDA, as far as one GPU can check it (these tests need a GPU; on a CPU
they are skipped, and the same code runs over gloo in test_tensor_parallel.py):

- NCCL with a world of one runs the sharded layers' real all-reduce and all-gather, also inside
  CUDA graphs, and computes what the unsharded model does;
- two ranks on the one GPU (NCCL refuses two ranks on a device, so gloo with CUDA tensors) compute
  the unsharded model's logits, and every buffer of a rank is on the rank's device.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backend.model.attention import TritonAttention
from backend.model.model_loader import load_model
from backend.model.model_runner import ModelRunner, StepInput
from backend.model.tensor_parallel import TensorParallelRank
from backend.parallel.distributed import all_gather

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[5, 9, 200, 17, 3, 3, 40], [100, 101, 102, 7]]
DECODE_STEPS = 6


def _greedy(runner: ModelRunner) -> tuple[list[torch.Tensor], list[list[int]]]:
    """A prefill, then DECODE_STEPS greedy decode steps (uniform: a graph can replay them)."""
    tables = [[0, 1], [2, 3]]  # block_size 16: room for 32 tokens each
    step = StepInput([], [], [], [])
    for prompt, table in zip(PROMPTS, tables):
        step.add(prompt, 0, table, 1)
    logits, tokens = [runner.run(step).float().cpu()], [[] for _ in PROMPTS]
    for _ in range(DECODE_STEPS):
        step = StepInput([], [], [], [])
        for i, (prompt, table) in enumerate(zip(PROMPTS, tables)):
            tokens[i].append(int(logits[-1][i].argmax()))
            step.add([tokens[i][-1]], len(prompt) + len(tokens[i]) - 1, table, 1)
        logits.append(runner.run(step).float().cpu())
    return logits, tokens


def _runner(model, device: torch.device) -> ModelRunner:
    return ModelRunner(model, TritonAttention(), num_blocks=8, block_size=16, device=device, dtype=torch.float32)


def test_nccl_world_of_one_runs_the_sharded_layers_in_graphs(tiny_llama, tmp_path):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    expected_logits, expected_tokens = _greedy(_runner(load_model(tiny_llama, "float32", device, 64)[0], device))
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        group = dist.new_group([0], backend="nccl")
        rank = TensorParallelRank(0, 1, lambda t: dist.all_reduce(t, group=group), lambda t: all_gather(t, group))
        runner = _runner(load_model(tiny_llama, "float32", device, 64, rank)[0], device)
        runner.capture_graphs(max_batch_size=2, max_model_len=64)
        logits, tokens = _greedy(runner)
    finally:
        dist.destroy_process_group()
    assert tokens == expected_tokens
    assert runner.graph_replays == DECODE_STEPS  # every decode step replayed a graph, its all-reduces in it
    for got, want in zip(logits, expected_logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _rank(rank: int, model_dir: str, rendezvous: str, out: str) -> None:
    device = torch.device("cuda", 0)  # both ranks on the one GPU
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    tp = TensorParallelRank(rank, 2, dist.all_reduce, lambda t: all_gather(t, dist.group.WORLD))
    model, _ = load_model(model_dir, "float32", device, 64, tp)
    runner = _runner(model, device)
    placed = {name: str(p.device) for name, p in model.named_parameters()}
    placed |= {f"kv_cache.{i}": str(k.device) for i, (k, _) in enumerate(runner.kv_caches)}
    logits, tokens = _greedy(runner)
    if rank == 0:
        torch.save({"logits": logits, "tokens": tokens, "placed": placed}, out)
    dist.destroy_process_group()


def test_two_ranks_on_one_gpu_compute_the_unsharded_model(tiny_llama, tmp_path):
    device = torch.device("cuda", 0)
    expected_logits, expected_tokens = _greedy(_runner(load_model(tiny_llama, "float32", device, 64)[0], device))
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(str(tiny_llama), str(tmp_path / "rendezvous"), str(out)), nprocs=2)
    got = torch.load(out)
    assert got["tokens"] == expected_tokens
    for sharded, whole in zip(got["logits"], expected_logits):
        torch.testing.assert_close(sharded, whole, atol=1e-4, rtol=1e-4)
    assert set(got["placed"].values()) == {"cuda:0"}, got["placed"]  # every weight and KV block on its GPU
