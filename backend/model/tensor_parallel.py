"""Tensor parallelism (Megatron-style sharding): each of N ranks keeps its share of every layer,
in tensor-parallel layers that do their own collectives, and the model's forward is unchanged.

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

The layers: ColumnParallelLinear (rows of a packed projection: q/k/v or gate/up, each cut
apart), RowParallelLinear (columns, then an all-reduce), VocabParallelEmbedding and
ParallelLMHead. `shard_model` puts them in place of a model's layers while it is still on the
meta device (shapes only); the loader then reads only the rank's rows and columns of each
checkpoint tensor (`checkpoint_slice`), so a rank never holds the whole model. `model.args` becomes the rank's view (its heads, KV heads and MLP width), so a ModelRunner built
on the sharded model sizes a KV pool of the rank's own KV heads, for the same block ids as every
other rank's.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from backend.model.model import Linear, LlamaForCausalLM, ModelArgs, PackedLinear

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
        self.quantized: nn.Module | None = None  # weight-only quantization: holds the weight instead

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        scores = nn.functional.linear(x, self.weight) if self.quantized is None else self.quantized(x)
        padded = nn.functional.pad(scores, (0, self.rows_per_rank - scores.shape[1]))  # equal shapes to gather
        return torch.cat(self.all_gather(padded), dim=1)[:, : self.vocab_size]


class ColumnParallelLinear(PackedLinear):
    """This rank's output rows of a packed projection: of each of its parts (q, k, v; gate, up),
    `shards[i]` of the unsharded part i (so the packed layout survives the cut). The input is
    whole, the output is this rank's share: no collective."""

    def __init__(self, in_features: int, shards: list[slice], bias: bool):
        super().__init__(in_features, [s.stop - s.start for s in shards], bias)
        self.shards = shards  # the unsharded parts' rows this rank holds, part by part


class RowParallelLinear(Linear):
    """This rank's input columns of a projection whose input is sharded (attention heads, MLP
    width): the ranks' partial outputs are summed (all-reduce), the bias added once, by rank 0."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, all_reduce: AllReduce):
        super().__init__(in_features, out_features, bias and rank == 0)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.all_reduce(out)
        return out


@dataclass(frozen=True, slots=True)
class TensorParallelRank:
    """One rank of N, and the collectives its sharded layers call."""

    rank: int
    world_size: int
    all_reduce: AllReduce
    all_gather: AllGather


@dataclass(frozen=True, slots=True)
class RankShare:
    """The rows and columns of the unsharded weights that a rank keeps."""

    heads: HeadShard
    vocab: slice  # rows of embed_tokens and lm_head
    vocab_rows_per_rank: int  # ceil(V / N): every rank's score width before the gather
    q: slice  # rows of q_proj, columns of o_proj
    kv: slice  # rows of k_proj and of v_proj
    mlp: slice  # rows of gate_proj and of up_proj, columns of down_proj


def rank_share(args: ModelArgs, rank: int, world_size: int) -> RankShare:
    rows_per_rank = -(-args.vocab_size // world_size)
    vocab = slice(min(rank * rows_per_rank, args.vocab_size), min((rank + 1) * rows_per_rank, args.vocab_size))
    heads = head_shard(args.num_heads, args.num_kv_heads, rank, world_size)
    if args.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide intermediate_size {args.intermediate_size}")
    width = args.intermediate_size // world_size
    d = args.head_dim
    return RankShare(heads, vocab, rows_per_rank, q=slice(heads.q_heads.start * d, heads.q_heads.stop * d),
                     kv=slice(heads.kv_heads.start * d, heads.kv_heads.stop * d),
                     mlp=slice(rank * width, (rank + 1) * width))


_CUT_ROWS = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_CUT_COLUMNS = {"o_proj": "q", "down_proj": "mlp"}


def checkpoint_slice(name: str, share: RankShare, rank: int) -> tuple[slice, ...] | None:
    """The part of checkpoint tensor `name` (an unsharded HF name) that a rank keeps, as an index
    into it; None when it keeps none of it (a row-parallel bias off rank 0: it has none)."""
    module_path, _, kind = name.rpartition(".")
    proj = module_path.rpartition(".")[2]
    if module_path in ("model.embed_tokens", "lm_head"):
        return (share.vocab,)
    if proj in _CUT_ROWS:  # column-parallel: output rows
        return (getattr(share, _CUT_ROWS[proj]),)
    if proj in _CUT_COLUMNS:  # row-parallel: input columns
        if kind == "bias":
            return (slice(None),) if rank == 0 else None
        return (slice(None), getattr(share, _CUT_COLUMNS[proj]))
    return (slice(None),)  # replicated: norms


def shard_model(model: LlamaForCausalLM, tp: TensorParallelRank) -> None:
    """Put rank `tp.rank`'s tensor-parallel layers in place of the model's own. The loader does
    it to a model still on the meta device (shapes only), then reads each weight's share
    (checkpoint_slice)."""
    args = model.args
    share = rank_share(args, tp.rank, tp.world_size)
    embedding, head = model.model.embed_tokens, model.lm_head  # None on a pipeline stage without them
    if embedding is not None:
        model.model.embed_tokens = VocabParallelEmbedding(embedding.weight.data, share.vocab.start, share.vocab.stop,
                                                          tp.all_reduce)
    if head is not None:
        model.lm_head = ParallelLMHead(head.weight.data, share.vocab.start, share.vocab.stop,
                                       share.vocab_rows_per_rank, args.vocab_size, tp.all_gather)
    if model.shares_embeddings:  # one copy of the shared rows
        model.lm_head.weight = model.model.embed_tokens.weight
    q_heads, kv_heads = len(share.heads.q_heads), len(share.heads.kv_heads)
    width = share.mlp.stop - share.mlp.start
    hidden = args.hidden_size
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.qkv_proj = ColumnParallelLinear(hidden, [share.q, share.kv, share.kv], args.qkv_bias)
        attn.num_heads, attn.num_kv_heads = q_heads, kv_heads
        attn.o_proj = RowParallelLinear(share.q.stop - share.q.start, hidden, args.o_bias, tp.rank, tp.all_reduce)
        mlp = layer.mlp
        mlp.gate_up_proj = ColumnParallelLinear(hidden, [share.mlp, share.mlp], args.mlp_bias)
        mlp.down_proj = RowParallelLinear(width, hidden, args.mlp_bias, tp.rank, tp.all_reduce)
    model.args = dataclasses.replace(args, num_heads=q_heads, num_kv_heads=kv_heads, intermediate_size=width)
