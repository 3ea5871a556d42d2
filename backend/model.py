"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5) as plain nn.Modules over a flat token batch.

Module names match the HF checkpoints, so weights load by name. The forward takes the step's
tokens flattened (no padding) and an `AttentionMetadata` that says where each request's queries
sit and where their K/V go in the paged cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backend.attention import AttentionBackend, AttentionMetadata


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE (HF's rotate_half layout) from a precomputed cos/sin table."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int):
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())  # [max_positions, head_dim // 2]
        self.register_buffer("cos", freqs.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, num_heads, head_dim]; positions: [num_tokens]
        cos = self.cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim // 2]
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)
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
        q = self.rotary(positions, self.q_proj(x).view(n, self.num_heads, self.head_dim))
        k = self.rotary(positions, self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        attn.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        o = attn.forward(q, k_cache, v_cache, meta, self.scale)  # [num_tokens, heads, head_dim]
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(args, layer_idx, rotary)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, positions, x, kv_cache, attn, meta) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, attn, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K pool, V pool)
        attn: AttentionBackend,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits] rows of the flat batch that need logits
    ) -> torch.Tensor:  # [num_logits, vocab] float32
        x = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(positions, x, kv_cache, attn, meta)
        x = self.model.norm(x[logits_indices])
        return self.lm_head(x).float()
