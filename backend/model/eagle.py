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

The target writes f_t for every position it computes into a feature pool indexed like its KV
cache (`feature_pool`, [slots + 1, H], the last row where padding writes go), so the head's first
forward of a step reads the features of the positions it has not seen by their KV slots; a
chained forward is handed the f^ of the forward before (`features`).

The checkpoint (scripts/train_eagle_draft.py writes it): config.json with "architecture":
"eagle_head", "final_norm" and "decoder_layer" (a Llama config of the layer), model.safetensors
(fc, layer.*, norm, lm_head, no embeddings) and optionally draft_vocab.safetensors.
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
    def __init__(self, args: ModelArgs, rotary: RotaryEmbedding, vocab_rows: int, final_norm: bool):
        super().__init__()
        self.args = args  # one layer: its KV pool is one layer's
        self.fc = Linear(2 * args.hidden_size, args.hidden_size, True)
        self.layer = DecoderLayer(args, 0, rotary)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if final_norm else None
        self.lm_head = Linear(args.hidden_size, vocab_rows, False)
        self.embed_tokens: nn.Embedding | None = None  # the target's (set by the loader)
        self.feature_pool: torch.Tensor | None = None  # the target's final hidden states by KV slot
        self.vocab_token_ids: torch.Tensor | None = None  # target ids of lm_head's rows; None: all

    @property
    def shares_embeddings(self) -> bool:
        return False

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]: x_{t+1} for each position t
        positions: torch.Tensor,  # [num_tokens]: t
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # its one layer's (K pool, V pool)
        attn: AttentionBackend,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits]
        features: torch.Tensor | None = None,  # [num_tokens, hidden] f_t; None: the pool's, by slot
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [num_logits, vocab rows] float32, f^ [num_logits, hidden]
        if features is None:
            features = self.feature_pool[meta.slot_mapping]
        x = self.fc(torch.cat([self.embed_tokens(input_ids), features], dim=-1).to(self.fc.weight.dtype))
        out, residual = self.layer(positions, x, None, kv_caches[0], attn, meta)
        hidden = (out + residual)[logits_indices]
        normed = self.norm(hidden) if self.norm is not None else hidden
        return self.lm_head(normed).float(), hidden

    def use_triton_kernels(self, enabled: bool) -> None:
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.use_triton_kernels = enabled
