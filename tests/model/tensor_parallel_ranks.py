"""The ranks of test_tensor_parallel.py's sharded-model test, in a module of their own that imports
only what a rank runs: each rank is a new process, and the test module (pytest, transformers'
models, the engine) costs 7 s of CPU to import where this costs 3.

Ranks fork from multiprocessing's fork server, which imports this module once and is itself a
fresh single-threaded process (forking the test process, with its threads, could deadlock).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backend.model.attention import TorchAttention
from backend.model.model_loader import load_model
from backend.model.model_runner import ModelRunner, StepInput
from backend.model.tensor_parallel import TensorParallelRank
from backend.parallel.distributed import all_gather

PROMPTS = [[5, 9, 200, 17, 3, 3, 40], [100, 101, 102, 7]]
TABLES = [[0, 1], [2, 3]]  # block_size 8: room for 16 tokens each
DECODE_STEPS = 4
RANK_START_METHOD = "forkserver"
mp.get_context(RANK_START_METHOD).set_forkserver_preload([__name__])  # (imported from the repository's root)


def generate(model) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Logits of a prefill and DECODE_STEPS greedy decode steps, and the tokens chosen. Every
    rank computes the same argmax from the same (reduced) logits, so they stay in step."""
    runner = ModelRunner(model, TorchAttention(), num_blocks=4, block_size=8, device=torch.device("cpu"),
                         dtype=torch.float32)
    step = StepInput([], [], [], [])
    for prompt, table in zip(PROMPTS, TABLES):
        step.add(prompt, 0, table, 1)
    logits, tokens = [runner.run(step)], [[] for _ in PROMPTS]
    for _ in range(DECODE_STEPS):
        step = StepInput([], [], [], [])
        for i, (prompt, table) in enumerate(zip(PROMPTS, TABLES)):
            tokens[i].append(int(logits[-1][i].argmax()))
            step.add([tokens[i][-1]], len(prompt) + len(tokens[i]) - 1, table, 1)
        logits.append(runner.run(step))
    return logits, tokens


def rank_main(rank: int, world_size: int, model_dir: str, rendezvous: str, out: str) -> None:
    """One rank: the sharded model's logits and tokens (rank 0 saves them, and its shapes, to `out`)."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    model, _ = load_model(model_dir, "float32", torch.device("cpu"), 64,
                          TensorParallelRank(rank, world_size, dist.all_reduce, lambda t: all_gather(t, dist.group.WORLD)))
    logits, tokens = generate(model)
    if rank == 0:
        torch.save({"logits": logits, "tokens": tokens, "kv_heads": model.args.num_kv_heads,
                    "vocab_rows": model.model.embed_tokens.weight.shape[0], "tied": model.lm_head.weight is
                    model.model.embed_tokens.weight}, out)
    dist.destroy_process_group()
