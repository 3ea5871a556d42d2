"""Pipeline parallelism on a CPU: the pipeline's bubble (the share of each stage's time spent
idle) with one batch in flight against `pipeline_parallel_size` batches, side by side in one run
with one rank, on the same greedy workload.

Each stage's rank runs its forwards on its own core(s) (`--threads` each): with one batch in
flight a stage waits while the others run, so its idle share approaches 1 - 1/P; with P batches
of different requests in flight every stage has work while the others do. The window is from the
first forward's start to the last one's end on any rank; rank 0's idle time includes the host's
work (scheduling, sampling), which the pipeline does not hide.

    python -m perf.bench_pipeline_parallel                    # a random 8-layer Llama, PP 2
    python -m perf.bench_pipeline_parallel --pipeline-parallel-size 4 --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from backend.config import EngineConfig
from backend.engine import LLMEngine
from perf.harness import add_model_and_workload_arguments, greedy_run, make_workload
from perf.random_checkpoints import write_random_llama

Intervals = list[tuple[float, float]]  # (start, end) of each forward, time.monotonic()


def run(config: EngineConfig, workload) -> tuple[float, list[Intervals], list[list[int]]]:
    """tok/s, every rank's forwards (rank 0 first), and the outputs."""
    engine = LLMEngine(config)
    rank0: Intervals = []
    runner = getattr(engine.runner, "runner", engine.runner)  # rank 0's own ModelRunner
    forward = runner.run

    def timed(*args):
        started = time.monotonic()
        try:
            return forward(*args)
        finally:
            rank0.append((started, time.monotonic()))

    runner.run = timed
    wall, outputs = greedy_run(engine, workload)
    ranks = [rank0] + (engine.workers.stage_busy if engine.workers is not None else [])
    return workload.useful_tokens / wall, ranks, outputs


def idle_shares(ranks: list[Intervals]) -> list[float]:
    """Per rank, the share of the common window it spent outside forwards."""
    start = min(i[0][0] for i in ranks)
    end = max(i[-1][1] for i in ranks)
    return [1 - sum(b - a for a, b in intervals) / (end - start) for intervals in ranks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipeline-parallel-size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    add_model_and_workload_arguments(ap)
    ap.set_defaults(layers=8, hidden=512, intermediate=2048, heads=8, kv_heads=8)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layer-partition", default="", help='a last row with these layers per stage, e.g. "6,4"')
    args = ap.parse_args()
    pp = args.pipeline_parallel_size
    runs = [(1, 1, ""), (pp, 1, ""), (pp, pp, "")] + ([(pp, pp, args.layer_partition)] if args.layer_partition else [])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_llama(Path(tmp), args)
        workload = make_workload(args.num_requests, args.vocab, args, args.seed)
        rows = []
        for stages, in_flight, partition in runs:
            config = EngineConfig(model=str(model_dir), num_threads=args.threads, max_num_seqs=args.max_num_seqs,
                                  pipeline_parallel_size=stages, max_batches_in_flight=in_flight,
                                  pipeline_layer_partition=partition)
            rows.append((stages, in_flight, partition or "even", *run(config, workload)))
    base = rows[0]
    print(f"random Llama: hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}, "
          f"vocab {args.vocab}; {args.num_requests} requests, {workload.useful_tokens} tokens, greedy; "
          f"{args.threads} thread(s) per rank, max_num_seqs {args.max_num_seqs}")
    print("| pipeline_parallel_size | batches in flight | layers per stage | tok/s | vs PP=1 "
          "| median forward ms per stage (0, 1, ...) | idle share per stage | mean idle share | outputs = PP=1 |")
    print("|---:|---:|---|---:|---:|---|---|---:|---|")
    for stages, in_flight, partition, tok_s, ranks, outputs in rows:
        idle = idle_shares(ranks)
        forward = ", ".join(f"{statistics.median(b - a for a, b in r) * 1000:.1f}" for r in ranks)
        print(f"| {stages} | {in_flight} | {partition} | {tok_s:.1f} | {tok_s / base[3]:.2f}x | {forward} | "
              f"{', '.join(f'{x:.0%}' for x in idle)} | {sum(idle) / len(idle):.0%} | {outputs == base[5]} |")


if __name__ == "__main__":
    main()
