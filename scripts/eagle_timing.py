"""Batch-1 forward times of the target, an EAGLE head and a standalone draft after CONTEXT cached
tokens, and the speculative speedup they imply."""

from __future__ import annotations

import statistics
import time

import torch

from perf.harness import sync
from scripts.eagle_head import EagleHead

CONTEXT = 128  # cached tokens in the timings


def median_time(fn, iters: int, device, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        tick = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - tick)
    return statistics.median(times)


@torch.inference_mode()
def target_time(target, queries: int, iters: int) -> float:
    """Median seconds of a target forward of `queries` tokens after CONTEXT cached ones (HF KV cache)."""
    from transformers import DynamicCache

    device = target.device
    cache = DynamicCache()
    target(torch.randint(10, 4000, (1, CONTEXT), device=device), cache=cache, use_cache=True)
    tokens = torch.randint(10, 4000, (1, queries), device=device)

    def forward():
        target(tokens, cache=cache, use_cache=True)
        cache.crop(-queries)
    return median_time(forward, iters, device)


@torch.inference_mode()
def head_time(head: EagleHead, embed, token_ids: torch.Tensor, iters: int) -> float:
    """Median seconds of one head forward (1 query, CONTEXT cached head keys) including the greedy pick."""
    width, device = (len(head.feature_layers) + 1) * head.config.hidden_size, token_ids.device
    context = head.inputs(embed(torch.randint(10, 4000, (1, CONTEXT), device=device)),
                          head.fused(torch.randn(1, CONTEXT, width, device=device)))
    _, k_ctx, v_ctx = head.qkv(context, torch.arange(CONTEXT, device=device))
    token, feat = torch.tensor([[42]], device=device), torch.randn(1, 1, head.config.hidden_size, device=device)
    ctx_mask = torch.ones(1, CONTEXT, dtype=torch.bool, device=device)
    position = torch.tensor([CONTEXT], device=device)

    def forward():
        x = head.inputs(embed(token), feat)
        q, k, v = head.qkv(x, position)
        out = head.block(x, q, k_ctx, v_ctx, ctx_mask, k.unsqueeze(-2), v.unsqueeze(-2))
        return token_ids[head.logits(out)[0, -1].argmax()]
    return median_time(forward, iters, device)


def timings(target, head, embed, token_ids, k: int, draft=None) -> dict:
    """Forward times in ms; c = head / target (1 query), verify_cost = target (k + 1 queries) / target (1);
    with a standalone draft, its 1-query forward and c too."""
    target_1 = target_time(target, 1, 40)
    target_k1 = target_time(target, k + 1, 40)
    head_s = head_time(head, embed, token_ids, 400)
    result = {"target_1_query_ms": target_1 * 1e3, "target_k_plus_1_queries_ms": target_k1 * 1e3,
              "head_ms": head_s * 1e3, "c": head_s / target_1, "verify_cost": target_k1 / target_1}
    if draft is not None:
        draft_s = target_time(draft, 1, 100)
        result.update(standalone_ms=draft_s * 1e3, standalone_c=draft_s / target_1)
    print("timings (batch 1, 128 cached tokens): " + ", ".join(f"{a} {b:.3f}" for a, b in result.items()), flush=True)
    return result


def speedup(expected_accepted: float, k: int, c: float, verify_cost: float) -> dict:
    """S = E[tokens per step] / (verification + k drafts), with verification = 1 and as measured."""
    tokens = 1 + expected_accepted
    return {"tokens_per_step": tokens, "S_verify_1": tokens / (1 + k * c),
            "S_verify_measured": tokens / (verify_cost + k * c)}
