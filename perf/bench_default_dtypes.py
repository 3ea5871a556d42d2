"""Which CPU dtype for the default model (SmolLM2-135M-Instruct): quality against float32 and speed.

On the held-out chat and code prompts (scripts/chat_prompts.py, rendered with the chat template),
greedy, up to --max-tokens new tokens each:

  HF float32     transformers in float32: the reference
  HF bfloat16    every weight, activation and the residual stream in bfloat16
  HF bf16-matmul the projections (q/k/v/o, gate/up/down, lm_head) run as bfloat16 matmuls on
                 bfloat16 copies of their weights, while the embeddings, RMSNorms, RoPE, attention
                 and the residual stream stay float32 (the inputs are cast to bfloat16 per matmul,
                 the outputs back to float32)
  engine float32 / bfloat16: this engine in-process (LLMEngine), every prompt at once

Quality: outputs identical to HF float32's, the common prefix as a share of HF float32's tokens,
teacher-forced top-1 agreement (each variant's argmax on HF float32's own continuation: numeric
drift without the compounding of a diverged prefix), and degenerate outputs (fewer than half of
an output's 4-grams distinct: a loop). Speed: HF tok/s at batch 1 (generate, prefill included),
HF prefill tok/s (one 512-token forward), engine tok/s with every prompt in flight and at batch 1.

    python -m perf.bench_default_dtypes --threads 1
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from perf.harness import common_prefix, engine_generate, strip_eos, teacher_forced_agreement
from perf.prompts import DEFAULT_TARGET
from scripts.chat_prompts import HELDOUT, chat


class Bf16Linear(nn.Module):
    """A projection run as a bfloat16 matmul between float32 activations: x is cast to bfloat16,
    the product (accumulated in float32 by the CPU's bf16 kernels) comes back as float32."""

    def __init__(self, weight: torch.Tensor):  # [out_features, in_features]
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight).float()


def bf16_matmul_model(model: nn.Module) -> nn.Module:
    """`model` (float32, Llama) with every projection and the lm_head replaced by Bf16Linear."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    assert child.bias is None
                    setattr(parent, name, Bf16Linear(child.weight))
    model.lm_head = Bf16Linear(model.lm_head.weight)  # a bf16 copy: the float32 embeddings stay
    return model


def load_hf(model_dir: Path, variant: str) -> nn.Module:
    dtype = torch.bfloat16 if variant == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).eval()
    return bf16_matmul_model(model) if variant == "bf16-matmul" else model


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_tokens: int, eos: int) -> tuple[list[list[int]], float]:
    outputs, tokens, start = [], 0, time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos)
        new = out[0, len(prompt):].tolist()
        tokens += len(new)
        outputs.append(strip_eos(new, eos))
    return outputs, tokens / (time.perf_counter() - start)


@torch.inference_mode()
def prefill_tokens_per_s(model, vocab_size: int, length: int = 512, repeats: int = 3) -> float:
    ids = torch.randint(3, vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    model(ids)  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        model(ids)
    return repeats * length / (time.perf_counter() - start)


def degenerate(ids: list[int]) -> bool:
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return len(grams) >= 16 and len(set(grams)) < len(grams) / 2


def quality(outputs: list[list[int]], reference: list[list[int]]) -> tuple[str, str, str]:
    same = sum(o == r for o, r in zip(outputs, reference))
    prefix = sum(common_prefix(o, r) for o, r in zip(outputs, reference)) / sum(len(r) for r in reference)
    return f"{same}/{len(reference)}", f"{prefix:.3f}", str(sum(degenerate(o) for o in outputs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_TARGET)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is steadiest on a shared CPU)")
    ap.add_argument("--num-prompts", type=int, default=len(HELDOUT))
    ap.add_argument("--engine-batch-1-prompts", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    eos = tok.eos_token_id
    texts = HELDOUT[:args.num_prompts]
    prompts = [tok.apply_chat_template(chat(t), add_generation_prompt=True, tokenize=True, return_dict=False)
               for t in texts]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]

    rows = []
    reference = None
    for variant in ("float32", "bfloat16", "bf16-matmul"):
        model = load_hf(args.model, variant)
        outputs, tps = hf_generate(model, prompts, args.max_tokens, eos)
        if reference is None:
            reference = outputs
        tf = teacher_forced_agreement(model, prompts, reference)
        prefill = prefill_tokens_per_s(model, tok.vocab_size)
        rows.append((f"HF {variant}", *quality(outputs, reference), f"{tf:.3f}", f"{tps:.1f}", f"{prefill:.0f}", "", ""))
        if variant == "bfloat16":
            for text, out, ref in zip(texts, outputs, reference):
                if degenerate(out) and not degenerate(ref):
                    print(f"bf16 degenerates on {text!r}: {tok.decode(out)[:160]!r}")
        del model
    for dtype in ("float32", "bfloat16"):
        outputs, tps = engine_generate(args.model, dtype, prompts, args.max_tokens, eos, args.threads, len(prompts))
        _, tps1 = engine_generate(args.model, dtype, prompts[:args.engine_batch_1_prompts], args.max_tokens, eos,
                                  args.threads, 1)
        rows.append((f"engine {dtype}", *quality(outputs, reference), "", "", "", f"{tps:.1f}", f"{tps1:.1f}"))

    print(f"\n{len(prompts)} held-out chat and code prompts, greedy, up to {args.max_tokens} new tokens, "
          f"{args.threads} thread(s); reference: HF float32 ({sum(map(len, reference))} tokens)\n")
    head = ("system", "outputs = HF fp32", "common prefix", "degenerate", "teacher-forced top-1",
            "HF batch-1 tok/s", "HF prefill tok/s", f"engine tok/s (batch {len(prompts)})", "engine batch-1 tok/s")
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
