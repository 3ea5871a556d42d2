"""Weight-only quantized layers on a CPU with and without their dense copies (`quantization_dense_rows`
-1 against 0, timed at load), side by side in one run on the default model:

    1. the copy's dtype on this CPU (bfloat16 where oneDNN multiplies it natively, else float32) and
       the rows from which the start-up tuner chose it, per weight shape
    2. the prefill of one prompt of 16-512 tokens (ms, in-process: TTFT without the server)
    3. tok/s with 8 and 32 chat prompts in flight, greedy, and whether the answers are the same

    python -m perf.bench_dense_copy --threads 2 --modes int4 int8
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoTokenizer

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.model.quantized_linear import dense_dtype
from perf.harness import engine_generate, prefill_ms
from perf.prompts import DEFAULT_TARGET, chat_prompts

COPIES = {"packed kernels only": -1, "{dtype} copies, timed at load": 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_TARGET)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["int4", "int8"], choices=["int4", "int8"])
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256, 512])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    prompts = chat_prompts(tokenizer, max(args.batches))
    print(f"{args.model.name}, {args.threads} thread(s); dense copies in {str(dense_dtype()).removeprefix('torch.')} "
          "on this CPU\n")
    rows = []
    for mode in args.modes:
        answers = {}
        for name, dense_rows in COPIES.items():
            engine = LLMEngine(EngineConfig(model=str(args.model), quantization=mode, quantization_dense_rows=dense_rows,
                                            num_threads=args.threads, max_num_seqs=64, speculative_method="none"))
            if dense_rows == 0:
                chosen = {shape: r["dense_min_rows"] for shape, r in engine.linear_choices["target"].items()}
                print(f"{mode}: rows from which each weight shape (out, in) uses its copy: {chosen}")
            prefill = [prefill_ms(engine, n, args.repeats) for n in args.lengths]
            tok_s = []
            for batch in args.batches:
                outputs, rate = engine_generate(args.model, "float32", prompts[:batch], args.max_tokens,
                                                tokenizer.eos_token_id, args.threads, batch, engine=engine)
                answers.setdefault(batch, []).append(outputs)
                tok_s.append(rate)
            rows.append((mode, name.format(dtype=str(dense_dtype()).removeprefix("torch.")), prefill, tok_s))
            engine.close()
        rows.append((mode, "same answers", None, [sum(a == b for a, b in zip(*answers[b])) for b in args.batches]))
    print("\n| mode | layers | " + " | ".join(f"prefill {n} tokens" for n in args.lengths) + " | "
          + " | ".join(f"tok/s, {b} in flight" for b in args.batches) + " |")
    print("|---|---|" + "---:|" * (len(args.lengths) + len(args.batches)))
    for mode, name, prefill, tok_s in rows:
        if prefill is None:
            print(f"| {mode} | answers equal | " + " | ".join("" for _ in args.lengths) + " | "
                  + " | ".join(f"{n}/{b}" for n, b in zip(tok_s, args.batches)) + " |")
            continue
        print(f"| {mode} | {name} | " + " | ".join(f"{ms:.1f} ms" for ms in prefill) + " | "
              + " | ".join(f"{r:.1f}" for r in tok_s) + " |")


if __name__ == "__main__":
    main()
