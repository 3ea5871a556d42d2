"""Tensor parallelism on a CPU: the same greedy workload through the engine at TP=1 and at TP=N,
side by side in one run, with the share of rank 0's time spent in all-reduces and step
broadcasts.

On one machine's CPU cores the ranks share what TP=1 uses alone (torch's threads), so expect
little speed-up: the figure is the cost of the communication, not a GPU's scaling.

    python -m perf.bench_tensor_parallel                       # a random 4-layer Llama, TP 1 vs 2
    python -m perf.bench_tensor_parallel --tensor-parallel-size 4 --threads 1
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from backend.config import EngineConfig
from backend.engine import LLMEngine
from perf.harness import Workload, add_model_and_workload_arguments, greedy_run, make_workload
from perf.random_checkpoints import write_random_llama


class Timer:
    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timed


def run(config: EngineConfig, workload: Workload) -> tuple[float, float, list[list[int]]]:
    """tok/s, the share of the wall time in communication (rank 0), and the outputs."""
    engine = LLMEngine(config)
    comm = Timer()
    if engine.workers is not None:
        engine.workers.broadcast = comm.wrap(engine.workers.broadcast)
        embed, head = engine.model.model.embed_tokens, engine.model.lm_head
        embed.all_reduce, head.all_gather = comm.wrap(embed.all_reduce), comm.wrap(head.all_gather)
        for layer in engine.model.model.layers:  # the hooks hold the all-reduce they were given
            for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
                for key, hook in list(module._forward_hooks.items()):
                    module._forward_hooks[key] = comm.wrap(hook)
    wall, outputs = greedy_run(engine, workload)
    return workload.useful_tokens / wall, comm.seconds / wall, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensor-parallel-size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    add_model_and_workload_arguments(ap)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_llama(Path(tmp), args)
        workload = make_workload(args.num_requests, args.vocab, args, args.seed)
        rows = []
        for tp in (1, args.tensor_parallel_size):
            config = EngineConfig(model=str(model_dir), num_threads=args.threads, tensor_parallel_size=tp)
            rows.append((tp, *run(config, workload)))
    base = rows[0]
    print(f"random Llama: hidden {args.hidden}, {args.layers} layers, {args.heads} heads, {args.kv_heads} KV heads; "
          f"{args.num_requests} requests, {workload.useful_tokens} tokens, greedy; {args.threads} thread(s) per rank")
    print("| tensor_parallel_size | tok/s | vs TP=1 | rank 0's time in collectives | outputs = TP=1 |")
    print("|---:|---:|---:|---:|---|")
    for tp, tok_s, comm, outputs in rows:
        print(f"| {tp} | {tok_s:.1f} | {tok_s / base[1]:.2f}x | {comm:.0%} | {outputs == base[3]} |")


if __name__ == "__main__":
    main()
