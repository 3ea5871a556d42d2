"""An EAGLE draft head (Li et al. 2024, arXiv 2401.15077): a draft that reads the target's own
final hidden states, so one decoder layer drafts what a small model of its own would need many
for.

At position t the head reads the target's final normed hidden state f_t and the embedding of the
next token x_{t+1} (the target's own embedding table, shared):
    x      = fc([embed(x_{t+1}); f_t])      2H -> H, with bias
    f^     = a Llama decoder layer (x)      its own K/V at position t, in its own paged pool
    logits = lm_head(norm(f^))              norm optional; lm_head over a reduced vocabulary
                                            (draft_vocab.safetensors) or the whole one
f^ stands for f_{t+1}: the logits draft x_{t+2}, and a chained draft reads [embed(d); f^] at t + 1.

With fused features (EAGLE-3, Li et al. 2025, arXiv 2503.01840; config "feature_layers": target
layers l_1 < ... < l_n) the target's features at t are more than f_t: the residual stream h_l,t
after each of those layers too, and the head's first forward reads in place of f_t
    g_t    = fuse([rms(h_l1,t); ...; rms(h_ln,t); f_t])   (n + 1) H -> H, no bias; rms(h) = h / RMS(h)
while chained forwards still read f^ (the head's own stand-in for what g would be).

The target writes its features for every position it computes into a feature pool indexed like its
KV cache (`feature_pool`, [slots + 1, (n + 1) H]: [h_l1; ...; h_ln; f], the last row where padding
writes go), so the head's first
forward of a step reads the features of the positions it has not seen by their KV slots; a
chained forward is handed the f^ of the forward before (`features`).

The checkpoint (scripts/train_eagle_draft.py writes it): config.json with "architecture":
"eagle_head", "final_norm" and "decoder_layer" (a Llama config of the layer), model.safetensors
(fc, fuse with feature_layers, layer.*, norm, lm_head, no embeddings) and optionally
draft_vocab.safetensors.
"""
from __future__ import annotations

import torch
from torch import nn

from backend.model.attention import AttentionBackend, AttentionMetadata
from backend.model.model import (
    MLP,
    DecoderLayer,
    Linear,
    ModelArgs,
    RMSNorm,
    RotaryEmbedding,
)

ARCHITECTURE = "eagle_head"


class EagleHead(nn.Module):
    def __init__(self, args: ModelArgs, rotary: RotaryEmbedding, vocab_rows: int, final_norm: bool,
                 feature_layers: tuple[int, ...] = ()):
        super().__init__()
        self.args = args  # one layer: its KV pool is one layer's
        self.fc = Linear(2 * args.hidden_size, args.hidden_size, True)
        self.feature_layers = feature_layers  # the target's layers whose residual streams g fuses; () f alone
        self.fuse = Linear(self.feature_width, args.hidden_size, False) if feature_layers else None
        self.layer = DecoderLayer(args, 0, rotary)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if final_norm else None
        self.lm_head = Linear(args.hidden_size, vocab_rows, False)
        self.embed_tokens: nn.Embedding | None = None  # the target's (set by the loader)
        self.feature_pool: torch.Tensor | None = None  # the target's final hidden states by KV slot
        self.vocab_token_ids: torch.Tensor | None = None  # target ids of lm_head's rows; None: all

    @property
    def shares_embeddings(self) -> bool:
        return False

    @property
    def feature_width(self) -> int:
        """Width of a feature pool row: the listed layers' residual streams and f."""
        return (len(self.feature_layers) + 1) * self.args.hidden_size

    def fused(self, features: torch.Tensor) -> torch.Tensor:  # [N, feature_width] -> [N, hidden]
        if self.fuse is None:
            return features
        *streams, final = features.split(self.args.hidden_size, -1)
        streams = [h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + self.args.rms_norm_eps).to(h.dtype)
                   for h in streams]
        return self.fuse(torch.cat([*streams, final], -1))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]: x_{t+1} for each position t
        positions: torch.Tensor,  # [num_tokens]: t
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # its one layer's (K pool, V pool)
        attn: AttentionBackend,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits]
        features: torch.Tensor | None = None,  # [num_tokens, hidden] f^ of a chained forward; None: the pool's
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [num_logits, vocab rows] float32, f^ [num_logits, hidden]
        if features is None:
            features = self.fused(self.feature_pool[meta.slot_mapping])
        x = self.fc(torch.cat([self.embed_tokens(input_ids), features], dim=-1).to(self.fc.weight.dtype))
        out, residual = self.layer(positions, x, None, kv_caches[0], attn, meta)
        hidden = (out + residual)[logits_indices]
        normed = self.norm(hidden) if self.norm is not None else hidden
        return self.lm_head(normed).float(), hidden

    def use_triton_kernels(self, enabled: bool) -> None:
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.use_triton_kernels = enabled
