"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5) as plain nn.Modules over a flat token batch.

Module names match the HF checkpoints, so weights load by name, except that q/k/v and gate/up
each run as one packed matmul (`qkv_proj`, `gate_up_proj`; the loader fills their row shards from
the checkpoint's separate tensors, see PACKED_PROJECTIONS). The forward takes the step's tokens
flattened (no padding) and an `AttentionMetadata` that says where each request's queries sit and
where their K/V go in the paged cache.

RMSNorm (with the residual add folded in) and the MLP's SiLU-multiply run as torch op chains, or
as one Triton kernel each when `use_triton_kernels` is set (CUDA, or CPU under TRITON_INTERPRET=1).
RoPE goes with the KV-cache store: the attention backend does both, the Triton one in one launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backend.model.attention import AttentionBackend, AttentionMetadata
from specserve_kernels.gemv import gemv
from specserve_kernels.rms_norm import (  # Triton itself is imported on a kernel's first call
    rms_norm,
    rms_norm_ref,
)
from specserve_kernels.silu_mul import silu_mul, silu_mul_ref


@dataclass(slots=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool  # Qwen2: bias on q, k, v
    o_bias: bool  # Llama attention_bias: bias on o too
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int


# checkpoint projection -> (packed module, shard index): one matmul where HF stores several
PACKED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Linear(nn.Linear):
    """nn.Linear that runs the Triton small-batch kernel (kernels/specserve_kernels/gemv.py) for up to
    `gemv_max_rows` rows of input, where the engine measured it faster than torch's matmul for
    this weight's shape (backend/model/linear_tuner.py; 0: never). On a CPU in float32 it can keep
    a copy of its weight in oneDNN's layout (`onednn_weight`) and multiply by it at the row counts
    in `onednn_rows`, where the engine measured that faster: torch's float32 matmul (MKL) leaves
    its matrix-vector path at 2 rows and re-packs the weight on every call, so a product of 2-64
    rows (decode batches, a speculative verification's k + 1) can cost 2-6x one of a row. With
    weight-only quantization its `quantized` layer holds the weight and bias instead
    (backend/model/quantized_linear.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias=bias)
        self.gemv_max_rows = 0
        self.onednn_weight: torch.Tensor | None = None
        self.onednn_rows = range(0)  # row counts that multiply by onednn_weight
        self.quantized: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x)
        if self.gemv_max_rows and x.shape[0] <= self.gemv_max_rows:
            return gemv(x, self.weight, self.bias)
        # (a compiled graph keeps torch's matmul; asked first, since a comparison of the traced row
        # count would become a condition on the graph)
        if (not torch.compiler.is_compiling() and self.onednn_weight is not None and x.dim() == 2
                and x.shape[0] in self.onednn_rows):
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.onednn_weight, self.bias, "none", [], "")
        return super().forward(x)


class PackedLinear(Linear):
    """Several projections of the same input stacked along the output rows."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = shard_sizes

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.shard_sizes[:shard])
        return slice(start, start + self.shard_sizes[shard])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_triton_kernels = False

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual, (norm(x + residual), x + residual)."""
        norm = rms_norm if self.use_triton_kernels else rms_norm_ref
        return norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE (HF's rotate_half layout): the precomputed cos/sin tables that the
    attention backend's `rotate_and_store` applies."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int):
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())  # [max_positions, head_dim // 2]
        self.register_buffer("cos", freqs.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_scaling, persistent=False)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = PackedLinear(args.hidden_size, [q_size, kv_size, kv_size], bias=args.qkv_bias)
        self.o_proj = Linear(q_size, args.hidden_size, args.o_bias)
        self.rotary = rotary
        self.scale = args.head_dim**-0.5

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        x: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, kv_heads, head_dim]
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x).view(n, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        k_cache, v_cache = kv_cache
        r = self.rotary
        q = attn.rotate_and_store(q, k, v, positions, r.cos, r.sin, k_cache, v_cache, meta.slot_mapping)
        o = attn.forward(q, k_cache, v_cache, meta, self.scale)  # [num_tokens, heads, head_dim]
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = PackedLinear(args.hidden_size, [args.intermediate_size] * 2, bias=args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, args.mlp_bias)
        self.use_triton_kernels = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = silu_mul if self.use_triton_kernels else silu_mul_ref
        return self.down_proj(act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(args, layer_idx, rotary)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, positions, x, residual, kv_cache, attn, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous layer's output before its residual add (the first layer: the
        embeddings, residual None); returns the same pair for the next layer."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, attn, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, rotary: RotaryEmbedding):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, rotary) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, rotary: RotaryEmbedding):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args, rotary)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # a draft with a reduced vocabulary (model_loader.DRAFT_VOCAB_FILE): the target token id
        # of each of its logits' columns, [draft_vocab] int64; None: the whole vocabulary
        self.vocab_token_ids: torch.Tensor | None = None
        # for an EAGLE draft (backend/model/eagle.py): every computed position's features go here, at its
        # KV slot ([slots + 1, (len(feature_layers) + 1) x hidden]: the residual stream after each of
        # feature_layers, then the final normed hidden state; padding rows write the last); None: not kept
        self.feature_pool: torch.Tensor | None = None
        self.feature_layers: tuple[int, ...] = ()

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K pool, V pool)
        attn: AttentionBackend,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits] rows of the flat batch that need logits
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,  # 2 x [num_tokens, hidden]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [num_logits, vocab] float32
        """The logits. A pipeline stage (backend/model/pipeline_parallel.py) runs some of the layers: a
        stage after the first starts from `intermediate`, the previous stage's (x, residual), and
        a stage before the last returns its own."""
        if self.model.embed_tokens is not None:
            x, residual = self.model.embed_tokens(input_ids), None
        else:
            x, residual = intermediate
        streams = []  # the residual stream after each of feature_layers, for the EAGLE head
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x, residual = layer(positions, x, residual, kv_cache, attn, meta)
            if self.feature_pool is not None and i in self.feature_layers:
                streams.append(x + residual)
        if self.lm_head is None:
            return x, residual
        if self.feature_pool is not None:  # every position's, for the EAGLE head
            x, _ = self.model.norm(x, residual)
            slots = meta.slot_mapping
            rows = torch.where(slots < 0, self.feature_pool.shape[0] - 1, slots)
            self.feature_pool.index_copy_(0, rows, torch.cat([*streams, x], -1) if streams else x)
            return self.lm_head(x[logits_indices]).float()
        x, _ = self.model.norm(x[logits_indices], residual[logits_indices])
        return self.lm_head(x).float()

    @property
    def shares_embeddings(self) -> bool:
        """lm_head is the embedding table itself: tied, and both held here (a pipeline stage
        holds one of them or neither)."""
        return self.args.tie_word_embeddings and self.model.embed_tokens is not None and self.lm_head is not None

    def use_triton_kernels(self, enabled: bool) -> None:
        """Run RMSNorm and SiLU-multiply as Triton kernels (RoPE, the KV store and attention are
        the AttentionBackend's choice)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.use_triton_kernels = enabled
