"""A worker rank of a parallel engine (backend/parallel/distributed.py): it holds its pipeline stage's
layers, its tensor-parallel share of them and of their KV cache, and runs every step's forward.

    SPECSERVE_RANK_SECRET=<hex> python -m backend.parallel.worker --rank R --world-size W --init-method URL [--parent PID]

A stage-0 rank gets each step by rank 0's broadcast; a later stage's rank receives it, with the
hidden states, from the same tp_rank of the stage before, and hands its own on; the last stage's
first rank sends the logits to rank 0. The engine's config comes from rank 0 once every rank has
joined, so a worker on another node needs only the rendezvous and the ranks' secret, which it
proves it holds when it joins (in its environment: a command line is world-readable). It exits
when told to (a None step), when a peer is gone (a collective fails), or when its parent process
is gone.
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import torch

from backend.config import EngineConfig
from backend.model.attention import make_attention_backend
from backend.model.model_loader import TORCH_DTYPES, load_hf_config, load_model
from backend.model.model_runner import ModelRunner, target_graph_query_lens
from backend.model.pipeline_parallel import pipeline_stage
from backend.parallel.distributed import (
    RANK_SECRET_VARIABLE,
    RankGroups,
    Sends,
    join,
    rank_secret_from_env,
    send_busy,
)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def run_rank(groups: RankGroups, config: EngineConfig) -> list[tuple[float, float]]:
    """Load this rank's part of the model, then run steps until told to stop. Returns when each
    forward started and ended (time.monotonic), for the pipeline's bubble."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = groups.device  # bound by join: this process steps on its main thread
    dtype = TORCH_DTYPES[config.dtype]
    hf_config = load_hf_config(config.model)
    max_model_len = config.max_model_len or hf_config.max_position_embeddings
    stage = pipeline_stage(hf_config.num_hidden_layers, groups.stage, groups.num_stages,
                           config.pipeline_layer_partition)
    model, _ = load_model(config.model, config.dtype, device, max_model_len, groups.tensor_parallel(), stage,
                          quantization=config.quantization, quantization_group_size=config.quantization_group_size)
    attention = make_attention_backend(config.attention_backend, device)
    model.use_triton_kernels(attention.name == "triton")
    num_blocks = groups.broadcast_num_blocks(None)  # rank 0's KV pool size
    runner = ModelRunner(model, attention, num_blocks, config.block_size, device, dtype)
    query_lens = target_graph_query_lens(config, device, attention)
    if query_lens:  # rank 0 captures the same graphs, in the same order: their all-reduces meet
        runner.capture_graphs(config.max_num_seqs, max_model_len, query_lens)
    previous = groups.stage_rank(groups.stage - 1) if groups.stage > 0 else None
    following = None if groups.is_last_stage else groups.stage_rank(groups.stage + 1)
    sends, busy = Sends(), []
    with torch.inference_mode():
        while True:
            if previous is None:
                step, intermediate = groups.broadcast_in_stage(None), None
            else:
                step, intermediate = groups.recv_step(previous, hf_config.hidden_size, dtype)
            if step is None:
                if following is not None:
                    groups.send_step(sends, None, (), following)
                break
            started = time.monotonic()
            out = runner.run(step, intermediate)
            busy.append((started, time.monotonic()))
            if following is not None:
                groups.send_step(sends, step, out, following)
            elif groups.tp_rank == 0 and out.shape[0]:  # (prompt chunks only: no logits)
                sends.send(out, 0, groups.device_everyone)
    sends.wait()
    return busy


def main() -> None:
    ap = argparse.ArgumentParser(description="specserve worker rank")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--init-method", required=True, help="file://PATH or tcp://ADDR:PORT")
    ap.add_argument("--parent", type=int, help="exit when this process is gone")
    args = ap.parse_args()
    if args.parent is not None:
        threading.Thread(target=_exit_with_parent, args=(args.parent,), daemon=True).start()
    try:
        secret = rank_secret_from_env()
    except ValueError as e:
        raise SystemExit(f"specserve worker: {e}") from None
    del os.environ[RANK_SECRET_VARIABLE]
    groups, config = join(args.init_method, args.rank, args.world_size, secret)
    busy = run_rank(groups, config)
    send_busy(busy, groups.everyone)  # rank 0 reports the bubble
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
