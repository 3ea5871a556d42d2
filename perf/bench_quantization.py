"""Quantization of the default model (`quantization`: int8, int4 by group size; fp8, whose products a
CPU only emulates, for its quality): quality against float32 and the batch-1 step against the
floor of the bytes it reads, all in one run.

Quality, on the held-out chat and code prompts (scripts/chat_prompts.py, chat template), greedy:
  agreement   teacher-forced top-1 agreement with float32: each mode's argmax at every position of
              float32's own answers (HF transformers' model with this engine's quantized layers
              swapped in, so numeric drift is measured without a diverged prefix compounding)
  identical   answers from this engine identical to its float32 answers, and the common prefix as
              a share of float32's tokens
  perplexity  on windows of held-out standard-library code (perf/prompts.py), relative to float32's
Speed, in-process (LLMEngine): the median batch-1 decode step, the bytes of weight it reads and
their floor at the machine's read bandwidth (measured here: a float32 sum over 1 GiB), and tok/s
with every prompt in flight.

    python -m perf.bench_quantization --threads 2
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.model.linear_swap import swap_linears
from perf.harness import (
    batch1_step_ms,
    common_prefix,
    engine_generate,
    read_bandwidth,
    teacher_forced_agreement,
    weight_bytes_per_step,
)
from perf.prompts import DEFAULT_TARGET, chat_prompts, heldout_texts

MODES = {  # name -> (quantization, group size)
    "float32": ("none", 32),
    "int8": ("int8", 32),
    "int4 g32": ("int4", 32),
    "int4 g64": ("int4", 64),
    "fp8": ("fp8", 32),  # (for its quality: a CPU runs FP8 products slowly)
}


def code_windows(tokenizer, n: int, length: int) -> list[list[int]]:
    windows = []
    for text in heldout_texts():
        ids = tokenizer(text, add_special_tokens=False).input_ids
        for start in range(0, len(ids) - length, length * 4):
            windows.append(ids[start:start + length])
            if len(windows) == n:
                return windows
    return windows


@torch.inference_mode()
def perplexity(model, windows: list[list[int]]) -> float:
    nll, count = 0.0, 0
    for ids in windows:
        x = torch.tensor([ids])
        logits = model(x).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        count += len(ids) - 1
    return float(torch.exp(torch.tensor(nll / count)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_TARGET)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--windows", type=int, default=16, help="perplexity windows of --window tokens")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--steps", type=int, default=48, help="batch-1 decode steps timed")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--compile-decode", action="store_true",
                   help="also run each mode with compile_decode: its batch-1 step, tok/s and answers beside the eager ones")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    eos = tokenizer.eos_token_id
    prompts = chat_prompts(tokenizer, args.prompts)
    windows = code_windows(tokenizer, args.windows, args.window)
    bandwidth = read_bandwidth()
    rows, reference, reference_ppl = [], None, None
    # mode -> compiled: batch-1 step ms, tok/s, answers equal to eager's, to float32's, common prefix with float32's
    compiled: dict[str, tuple[float, float, int, int, float]] = {}
    for name in args.modes:
        mode, group = MODES[name]
        engine = LLMEngine(EngineConfig(model=str(args.model), num_threads=args.threads, max_num_seqs=64,
                                        quantization=mode, quantization_group_size=group))
        outputs, tok_s = engine_generate(args.model, "float32", prompts, args.max_tokens, eos, args.threads,
                                         len(prompts), engine=engine)
        step_ms = batch1_step_ms(engine, prompts[0], args.steps)
        weight_bytes = weight_bytes_per_step(engine.model)
        engine.close()
        del engine
        if args.compile_decode:
            engine = LLMEngine(EngineConfig(model=str(args.model), num_threads=args.threads, max_num_seqs=64,
                                            quantization=mode, quantization_group_size=group, compile_decode=True))
            compiled_outputs, compiled_tok_s = engine_generate(args.model, "float32", prompts, args.max_tokens, eos,
                                                               args.threads, len(prompts), engine=engine)
            reference_outputs = outputs if reference is None else reference  # float32's, the first mode
            compiled[name] = (batch1_step_ms(engine, prompts[0], args.steps), compiled_tok_s,
                              sum(c == o for c, o in zip(compiled_outputs, outputs)),
                              sum(c == r for c, r in zip(compiled_outputs, reference_outputs)),
                              sum(common_prefix(c, r) for c, r in zip(compiled_outputs, reference_outputs))
                              / sum(len(r) for r in reference_outputs))
            del engine
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, local_files_only=True).eval()
        swap_linears(hf, mode, group)
        if reference is None:
            reference = outputs
        answer_tokens = sum(len(r) for r in reference)
        agreement = teacher_forced_agreement(hf, prompts, reference)
        ppl = perplexity(hf, windows)
        reference_ppl = reference_ppl or ppl
        identical = sum(o == r for o, r in zip(outputs, reference))
        prefix = sum(common_prefix(o, r) for o, r in zip(outputs, reference)) / answer_tokens
        floor_ms = weight_bytes / bandwidth * 1e3
        rows.append((name, agreement, identical, prefix, ppl, ppl / reference_ppl - 1, weight_bytes, step_ms,
                     floor_ms, tok_s))
        print(f"{name}: done", flush=True)
        del hf
    print(f"\n{args.model.name}, {args.threads} torch thread(s), {len(prompts)} held-out prompts x {args.max_tokens} "
          f"tokens ({answer_tokens} float32 answer tokens), perplexity on {len(windows)} x {args.window} tokens of "
          f"held-out code; read bandwidth {bandwidth / 1e9:.1f} GB/s\n")
    print("| mode | agreement | identical answers | common prefix | perplexity (vs float32) | weights read per "
          "step | batch-1 step | floor | step / floor | tok/s, all in flight |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, agreement, identical, prefix, ppl, rel, weight_bytes, step_ms, floor_ms, tok_s in rows:
        print(f"| {name} | {agreement:.4f} | {identical}/{len(prompts)} | {prefix:.3f} | {ppl:.3f} ({rel:+.2%}) | "
              f"{weight_bytes / 1e6:.0f} MB | {step_ms:.1f} ms | {floor_ms:.1f} ms | {step_ms / floor_ms:.2f}x | "
              f"{tok_s:.1f} |")
    if compiled:
        print("\nThe same engines with compile_decode (decode steps compiled; prefill eager):\n")
        print("| mode | batch-1 step eager | compiled | compiled / floor | tok/s all in flight eager | compiled | "
              "answers equal to eager's | to float32's (eager) | common prefix with float32 (eager) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, _, identical, prefix, _, _, _, step_ms, floor_ms, tok_s in rows:
            c_step, c_tok_s, same, c_identical, c_prefix = compiled[name]
            print(f"| {name} | {step_ms:.1f} ms | {c_step:.1f} ms | {c_step / floor_ms:.2f}x | {tok_s:.1f} | "
                  f"{c_tok_s:.1f} | {same}/{len(prompts)} | {c_identical}/{len(prompts)} ({identical}/{len(prompts)}) | "
                  f"{c_prefix:.3f} ({prefix:.3f}) |")


if __name__ == "__main__":
    main()
