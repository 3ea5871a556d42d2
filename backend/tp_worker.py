"""A tensor-parallel worker: rank r of N holds its shard of the target model and of the KV cache,
and runs every step's forward that rank 0 broadcasts (backend/tp_group.py).

    python -m backend.tp_worker --config JSON --rank R --rendezvous FILE --parent PID

It exits when told to (a None step), or when its parent, the engine's process, is gone.
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import torch
import torch.distributed as dist

from backend.attention import make_attention_backend
from backend.config import EngineConfig
from backend.engine import resolve_device
from backend.model_loader import TORCH_DTYPES, load_hf_config, load_model
from backend.model_runner import ModelRunner
from backend.tensor_parallel import TensorParallelRank
from backend.tp_group import _init_group, all_gather


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description="specserve tensor-parallel worker")
    ap.add_argument("--config", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--rendezvous", required=True)
    ap.add_argument("--parent", type=int, required=True)
    args = ap.parse_args()
    threading.Thread(target=_exit_with_parent, args=(args.parent,), daemon=True).start()
    config = EngineConfig.from_json(args.config)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    group = _init_group(args.rendezvous, args.rank, config.tensor_parallel_size)
    device = resolve_device(config.device)
    max_model_len = config.max_model_len or load_hf_config(config.model).max_position_embeddings
    rank = TensorParallelRank(args.rank, config.tensor_parallel_size, lambda t: dist.all_reduce(t, group=group),
                              lambda t: all_gather(t, group))
    model, _ = load_model(config.model, config.dtype, device, max_model_len, rank)
    attention = make_attention_backend(config.attention_backend, device)
    model.use_triton_kernels(attention.name == "triton")
    setup = [None]
    dist.broadcast_object_list(setup, src=0, group=group)  # rank 0's KV pool size: {"num_blocks": n}
    runner = ModelRunner(model, attention, setup[0]["num_blocks"], config.block_size, device, TORCH_DTYPES[config.dtype])
    with torch.inference_mode():
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0, group=group)
            if message[0] is None:
                break
            runner.run(message[0])
    dist.destroy_process_group(group)


if __name__ == "__main__":
    main()
