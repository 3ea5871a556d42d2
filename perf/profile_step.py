"""Where a batch-1 decode step's time goes, part by part, against the floor of the bytes it reads.

The default model in-process (LLMEngine), one request decoding: every part of every layer is
timed by wrapping its forward (norms, each projection, RoPE with the KV store, paged attention),
then the lm_head, sampling and the engine's host work, summed per step. The floor is the
weights' bytes over the machine's read bandwidth (a float32 sum over 1 GiB, measured here).
Wrapping adds a little time to each part; the step is also timed unwrapped. With
--compile-decode the same step is then timed compiled (compile_decode; a compiled graph has no
parts to wrap), against the eager one and the floor.

    python -m perf.profile_step --quantization int4 --threads 1 [--compile-decode]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from backend.config import EngineConfig
from backend.engine import LLMEngine
from perf.harness import PartTimer, TimedSampler, decode_steps, read_bandwidth, weight_bytes_per_step
from perf.prompts import DEFAULT_TARGET


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_TARGET)
    p.add_argument("--quantization", default="none")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--compile-decode", action="store_true", help="also time the step compiled")
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=str(args.model), num_threads=args.threads, quantization=args.quantization))
    plain = statistics.median(decode_steps(engine, args.steps))
    timer = PartTimer()
    model = engine.runner.model
    parts = [("input norms", "input_layernorm"), ("post-attention norms", "post_attention_layernorm"),
             ("qkv projections", "self_attn.qkv_proj"), ("o projections", "self_attn.o_proj"),
             ("gate_up projections", "mlp.gate_up_proj"), ("down projections", "mlp.down_proj")]
    for layer in model.model.layers:
        for label, path in parts:
            timer.wrap(layer.get_submodule(path), "forward", label)
        timer.wrap(layer, "forward", "layers (all of it)")
    timer.wrap(engine.attention, "rotate_and_store", "RoPE and KV store")
    timer.wrap(engine.attention, "forward", "paged attention")
    timer.wrap(model.lm_head, "forward", "lm_head")
    timer.wrap(model, "forward", "model forward (all of it)")
    engine.sampler = TimedSampler(engine, timer, "sampling")
    steps = decode_steps(engine, args.steps, timer.seconds.clear)
    total = sum(steps)
    per_step = {label: seconds / len(steps) * 1e3 for label, seconds in timer.seconds.items()}
    projections = sum(per_step[label] for label, _ in parts[2:])
    layers = per_step["layers (all of it)"]
    per_step["rest of the layers (residual, splits, views)"] = layers - sum(
        per_step[label] for label in per_step if label not in ("layers (all of it)", "lm_head", "sampling",
                                                               "model forward (all of it)"))
    per_step["engine host work (schedule, inputs, outputs)"] = (
        total / len(steps) * 1e3 - per_step["model forward (all of it)"] - per_step["sampling"])
    weight_bytes = weight_bytes_per_step(model)
    floor = weight_bytes / read_bandwidth() * 1e3
    print(f"\n{args.model.name}, quantization {args.quantization}, {args.threads} torch thread(s), batch 1, "
          f"{len(steps)} decode steps; step {plain * 1e3:.2f} ms unwrapped, {total / len(steps) * 1e3:.2f} ms "
          f"wrapped; floor {floor:.2f} ms ({weight_bytes / 1e6:.0f} MB of weights)\n")
    print("| part | ms per step | share of the step |")
    print("|---|---:|---:|")
    step_ms = total / len(steps) * 1e3
    for label, ms in per_step.items():
        print(f"| {label} | {ms:.2f} | {ms / step_ms:.0%} |")
    print(f"| (projections together) | {projections:.2f} | {projections / step_ms:.0%} |")
    if args.compile_decode:
        compiled = LLMEngine(EngineConfig(model=str(args.model), num_threads=args.threads,
                                          quantization=args.quantization, compile_decode=True))
        step = statistics.median(decode_steps(compiled, args.steps))
        print(f"\n| step | ms | vs floor |\n|---|---:|---:|\n| eager | {plain * 1e3:.2f} | {plain * 1e3 / floor:.2f}x |\n"
              f"| compiled (compile_decode) | {step * 1e3:.2f} | {step * 1e3 / floor:.2f}x |\n"
              f"| floor | {floor:.2f} | 1.00x |")


if __name__ == "__main__":
    main()
