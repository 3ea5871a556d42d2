"""Tensor parallelism applied to a loaded model from outside it (Megatron-style sharding, the way
gpt-fast's `apply_tp` does it): each of N ranks keeps its share of every layer, and the outputs
of the row-parallel projections are summed across ranks.

    qkv_proj      column-parallel: rank r keeps q heads [r H/N, (r+1) H/N) and the KV heads they
                  read: KV/N of them, or, when N > KV, the one KV head its q heads share (KV heads
                  are then replicated, N/KV ranks each)
    o_proj        row-parallel: the columns of its q heads, then all-reduce (bias on rank 0 only)
    gate_up_proj  column-parallel: rows [r I/N, (r+1) I/N) of gate and of up
    down_proj     row-parallel: the matching columns, then all-reduce (bias on rank 0 only)
    embed_tokens  vocab-parallel: rank r keeps rows [r V', (r+1) V') (V' = ceil(V / N)); a token
                  outside them embeds as zeros, and the ranks' embeddings are summed
    lm_head       vocab-parallel: each rank scores its rows, the scores are gathered (every rank
                  gets the whole logits; rank 0 alone samples)
    norms         replicated

`model.args` becomes the rank's view (its heads, KV heads and MLP width), so a ModelRunner built
on the sharded model sizes a KV pool of the rank's own KV heads, for the same block ids as every
other rank's.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from backend.model import LlamaForCausalLM, Linear

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the ranks, in place
AllGather = Callable[[torch.Tensor], list[torch.Tensor]]  # every rank's tensor (same shape), in rank order


@dataclass(frozen=True, slots=True)
class HeadShard:
    q_heads: range  # the query heads this rank computes
    kv_heads: range  # the KV heads they read


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadShard:
    if num_heads % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide the {num_heads} attention heads")
    per_rank = num_heads // world_size
    q_heads = range(rank * per_rank, (rank + 1) * per_rank)
    if num_kv_heads >= world_size:
        if num_kv_heads % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} must divide the {num_kv_heads} KV heads")
        kv_per_rank = num_kv_heads // world_size
        return HeadShard(q_heads, range(rank * kv_per_rank, (rank + 1) * kv_per_rank))
    if world_size % num_kv_heads:
        raise ValueError(f"the {num_kv_heads} KV heads must divide tensor_parallel_size {world_size}")
    kv_head = rank // (world_size // num_kv_heads)  # the KV head its q heads read (replicated)
    return HeadShard(q_heads, range(kv_head, kv_head + 1))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, stop) of the embedding table; the ranks' outputs are summed."""

    def __init__(self, weight: torch.Tensor, start: int, stop: int, all_reduce: AllReduce):
        super().__init__()
        self.weight = nn.Parameter(weight[start:stop].clone(), requires_grad=False)
        self.start, self.stop, self.all_reduce = start, stop, all_reduce

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        mine = (input_ids >= self.start) & (input_ids < self.stop)
        local = torch.where(mine, input_ids - self.start, 0)
        out = nn.functional.embedding(local, self.weight) * mine[:, None].to(self.weight.dtype)
        self.all_reduce(out)
        return out


class ParallelLMHead(nn.Module):
    """Scores for this rank's vocabulary rows; the ranks' scores gathered into the whole logits."""

    def __init__(self, weight: torch.Tensor, start: int, stop: int, rows_per_rank: int, vocab_size: int,
                 all_gather: AllGather):
        super().__init__()
        self.weight = nn.Parameter(weight[start:stop].clone(), requires_grad=False)
        self.rows_per_rank, self.vocab_size, self.all_gather = rows_per_rank, vocab_size, all_gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        scores = nn.functional.linear(x, self.weight)
        padded = nn.functional.pad(scores, (0, self.rows_per_rank - scores.shape[1]))  # equal shapes to gather
        return torch.cat(self.all_gather(padded), dim=1)[:, : self.vocab_size]


def _keep_rows(linear: Linear, rows: list[slice]) -> None:
    """Keep these output rows (in this order) of a linear layer's weight and bias."""
    linear.weight = nn.Parameter(torch.cat([linear.weight.data[r] for r in rows]), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(torch.cat([linear.bias.data[r] for r in rows]), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: Linear, columns: slice, rank: int, all_reduce: AllReduce) -> None:
    """Keep these input columns of a row-parallel layer; its output is summed over the ranks
    (the bias is added once, by rank 0)."""
    linear.weight = nn.Parameter(linear.weight.data[:, columns].contiguous(), requires_grad=False)
    linear.in_features = linear.weight.shape[1]
    if linear.bias is not None and rank != 0:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias.data), requires_grad=False)

    def reduce(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        all_reduce(output)

    linear.register_forward_hook(reduce)


def shard_model(model: LlamaForCausalLM, rank: int, world_size: int, all_reduce: AllReduce,
                all_gather: AllGather) -> None:
    """Cut a loaded model down to rank `rank`'s share, in place."""
    args = model.args
    rows_per_rank = -(-args.vocab_size // world_size)
    start, stop = min(rank * rows_per_rank, args.vocab_size), min((rank + 1) * rows_per_rank, args.vocab_size)
    embedding = model.model.embed_tokens.weight.data
    head = model.lm_head.weight.data  # the same tensor when the embeddings are tied
    model.model.embed_tokens = VocabParallelEmbedding(embedding, start, stop, all_reduce)
    model.lm_head = ParallelLMHead(head, start, stop, rows_per_rank, args.vocab_size, all_gather)
    if args.tie_word_embeddings:  # one copy of the shared rows
        model.lm_head.weight = model.model.embed_tokens.weight
    d = args.head_dim
    shard = head_shard(args.num_heads, args.num_kv_heads, rank, world_size)
    if args.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide intermediate_size {args.intermediate_size}")
    width = args.intermediate_size // world_size
    q_rows = slice(shard.q_heads.start * d, shard.q_heads.stop * d)
    k_start = args.num_heads * d
    v_start = k_start + args.num_kv_heads * d
    kv = slice(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    for layer in model.model.layers:
        attn = layer.self_attn
        _keep_rows(attn.qkv_proj, [q_rows, slice(k_start + kv.start, k_start + kv.stop),
                                   slice(v_start + kv.start, v_start + kv.stop)])
        attn.qkv_proj.shard_sizes = [len(shard.q_heads) * d, len(shard.kv_heads) * d, len(shard.kv_heads) * d]
        attn.num_heads, attn.num_kv_heads = len(shard.q_heads), len(shard.kv_heads)
        _keep_columns(attn.o_proj, q_rows, rank, all_reduce)
        mlp = layer.mlp
        mine = slice(rank * width, (rank + 1) * width)
        _keep_rows(mlp.gate_up_proj, [mine, slice(args.intermediate_size + mine.start, args.intermediate_size + mine.stop)])
        mlp.gate_up_proj.shard_sizes = [width, width]
        _keep_columns(mlp.down_proj, mine, rank, all_reduce)
    model.args = dataclasses.replace(args, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads),
                                     intermediate_size=width)
