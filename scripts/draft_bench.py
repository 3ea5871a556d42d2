"""Batch-1 decode forward time of draft shapes vs the target (float32, HF Llama, KV cache).

    nice -n 19 python -m scripts.draft_bench --threads 2 --shapes 1:8192 2:8192 2:16384 3:4096
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

TARGET = Path(__file__).resolve().parent.parent / "model_repository" / "llm_engine" / "1" / "target"


@torch.inference_mode()
def step_time(model, context: int = 128, steps: int = 64, repeats: int = 3) -> float:
    """Median over repeats of the mean seconds per single-token forward after a `context` prefill."""
    from transformers import DynamicCache
    times = []
    for _ in range(repeats):
        cache = DynamicCache()
        ids = torch.randint(10, 4000, (1, context))
        model(ids, past_key_values=cache, use_cache=True)
        tok = torch.tensor([[42]])
        start = time.perf_counter()
        for _ in range(steps):
            model(tok, past_key_values=cache, use_cache=True)
        times.append((time.perf_counter() - start) / steps)
    return sorted(times)[len(times) // 2]


def draft_shape(target_config, layers: int, vocab: int):
    from transformers import LlamaForCausalLM
    config = target_config.__class__.from_dict(target_config.to_dict())
    config.num_hidden_layers = layers
    config.vocab_size = vocab
    config.tie_word_embeddings = False  # reduced head: its own rows
    return LlamaForCausalLM(config).float().eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=["1:8192", "2:8192", "2:16384", "3:4096", "2:49152"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32, local_files_only=True).eval()
    t = step_time(target)
    print(f"threads {args.threads}: target {t * 1e3:.2f} ms/token")
    for shape in args.shapes:
        layers, vocab = map(int, shape.split(":"))
        d = step_time(draft_shape(target.config, layers, vocab))
        print(f"  draft {layers} layers, vocab {vocab}: {d * 1e3:.2f} ms/token, ratio {d / t:.3f}", flush=True)


if __name__ == "__main__":
    main()
