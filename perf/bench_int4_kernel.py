"""int4 on a CPU: the int4 CPU kernel (kernels/specserve_kernels/int4_cpu.py, int16 activations in integer products;
on a CPU with AVX-512 its AVX-512 build beside its AVX2 one) against torch's packed kernel
(`_weight_int4pack_mm_for_cpu`, bfloat16 activations), side by side in one run on the default model:

    1. per layer shape, one product at 1-64 rows of input (ms), beside a float32 GEMM of the
       dequantized weight and the floor of the int4 bytes at the measured read bandwidth
    2. in-process, the engine with each kernel (`quantization_dense_rows` timed at load, the
       default): the prefill of one prompt of 13-256 tokens, the median batch-1 decode step
       (eager and with `compile_decode`), tok/s with 8 and 32 chat prompts in flight, and how many
       greedy answers equal the other kernel's

    python -m perf.bench_int4_kernel --threads 2
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.model.linear_tuner import time_call
from backend.model.quantized_linear import Int4Linear
from specserve_kernels import int4_cpu
from perf.harness import batch1_step_ms, engine_generate, prefill_ms, read_bandwidth
from perf.prompts import DEFAULT_TARGET, chat_prompts

AVX2 = "int4 CPU kernel, AVX2"  # on a CPU with AVX-512 only: the kernel it would run without
KERNELS = ("int4 CPU kernel", "torch packed")
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (out, in)


@contextlib.contextmanager
def kernel_choice(name: str):
    """int4 layers built and run in the named kernel's layout meanwhile."""
    available, isa = int4_cpu.available, int4_cpu.isa
    if name == "torch packed":
        int4_cpu.available = lambda: False
    if name == AVX2:
        int4_cpu.isa = lambda: "avx2"
    try:
        yield
    finally:
        int4_cpu.available, int4_cpu.isa = available, isa


def with_kernel(name: str, build):
    """build() with int4 layers in the named kernel's layout."""
    with kernel_choice(name):
        return build()


def median_ms(fn, repeats: int) -> float:
    return time_call(fn, None, repeats) * 1e3  # (after one call: the warm-up)


@torch.inference_mode()
def layer_table(rows_list: list[int], repeats: int, bandwidth: float) -> None:
    avx512 = int4_cpu.isa() == "avx512"
    print(f"| layer (out x in) | rows | int4 CPU kernel ({int4_cpu.isa()}) |{' AVX2 build |' * avx512} torch packed | "
          f"float32 GEMM | int4 bytes' floor | torch / kernel |")
    print("|---|---:|---:|" + "---:|" * avx512 + "---:|---:|---:|---:|")
    for name, (out, width) in SHAPES.items():
        weight = torch.randn(out, width) * 0.05
        layers = {k: with_kernel(k, lambda: Int4Linear(weight, None, 32)) for k in KERNELS}
        dense = layers["int4 CPU kernel"].dequantized_weight()
        floor = out * width * (0.5 + 4 / 32) / bandwidth * 1e3
        for rows in rows_list:
            x = torch.randn(rows, width)
            kernel, packed = (median_ms(lambda: layers[k](x), repeats) for k in KERNELS)
            gemm = median_ms(lambda: x @ dense.t(), repeats)
            with kernel_choice(AVX2):
                avx2 = f" {median_ms(lambda: layers[KERNELS[0]](x), repeats):.3f} ms |" if avx512 else ""
            print(f"| {name} ({out} x {width}) | {rows} | {kernel:.3f} ms |{avx2} {packed:.3f} ms | {gemm:.3f} ms | "
                  f"{floor:.3f} ms | {packed / kernel:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_TARGET)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 13, 64])
    p.add_argument("--lengths", type=int, nargs="+", default=[13, 64, 256])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-layers", action="store_true")
    args = p.parse_args()
    if not int4_cpu.available():
        sys.exit("the int4 CPU kernel does not run on this machine (an x86 CPU with AVX2 and a C compiler)")
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    print(f"{args.model.name}, {args.threads} thread(s), {torch.backends.cpu.get_cpu_capability()}; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s\n")
    if not args.skip_layers:
        layer_table(args.rows, args.repeats, bandwidth)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    prompts = chat_prompts(tokenizer, max(args.batches))
    results, answers = {}, {}
    kernels = (KERNELS[0], AVX2, KERNELS[1]) if int4_cpu.isa() == "avx512" else KERNELS
    for kernel in kernels:
        for compiled in (False, True):
            with kernel_choice(kernel):
                engine = LLMEngine(EngineConfig(
                    model=str(args.model), quantization="int4", num_threads=args.threads, max_num_seqs=64,
                    speculative_method="none", compile_decode=compiled))
                step = batch1_step_ms(engine, prompts[0], 32)
                prefill = [prefill_ms(engine, n, 5) for n in args.lengths] if not compiled else None
                tok_s = []
                for batch in args.batches:
                    outputs, rate = engine_generate(args.model, "float32", prompts[:batch], args.max_tokens,
                                                    tokenizer.eos_token_id, args.threads, batch, engine=engine)
                    answers.setdefault((compiled, batch), []).append(outputs)
                    tok_s.append(rate)
                results[kernel, compiled] = (prefill, step, tok_s)
                engine.close()
    print("\n| int4 products | " + " | ".join(f"prefill {n} tokens" for n in args.lengths)
          + " | batch-1 step, eager | compiled | " + " | ".join(f"tok/s, {b} in flight (compiled)" for b in args.batches)
          + " |")
    print("|---|" + "---:|" * (len(args.lengths) + 2 + len(args.batches)))
    for kernel in kernels:
        (prefill, eager_step, _), (_, step, tok_s) = results[kernel, False], results[kernel, True]
        print(f"| {kernel} | " + " | ".join(f"{ms:.1f} ms" for ms in prefill) + f" | {eager_step:.2f} ms | {step:.2f} ms | "
              + " | ".join(f"{r:.1f}" for r in tok_s) + " |")
    ratio = [a / b for a, b in zip(results[KERNELS[1], False][0], results[KERNELS[0], False][0])]
    print("| speedup of the int4 CPU kernel | " + " | ".join(f"{r:.2f}x" for r in ratio)
          + f" | {results[KERNELS[1], False][1] / results[KERNELS[0], False][1]:.2f}x"
          + f" | {results[KERNELS[1], True][1] / results[KERNELS[0], True][1]:.2f}x | "
          + " | ".join(f"{a / b:.2f}x" for a, b in zip(results[KERNELS[0], True][2], results[KERNELS[1], True][2])) + " |")
    for i, kernel in enumerate(kernels[1:], 1):
        same = [sum(a == b for a, b in zip(answers[True, batch][0], answers[True, batch][i])) for batch in args.batches]
        print(f"\ngreedy answers of {kernel} equal to the int4 CPU kernel's (compiled): "
              + ", ".join(f"{n}/{b} at {b} in flight" for n, b in zip(same, args.batches)))


if __name__ == "__main__":
    main()
