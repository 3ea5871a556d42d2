"""The EAGLE head as trained here (scripts/train_eagle_draft.py): fc, one Llama decoder layer, an
optional norm and a reduced lm_head; started from target weights, saved and loaded in the format
backend/model/eagle.py serves."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


def attention(q, k_ctx, v_ctx, ctx_mask, k_own, v_own):
    """Grouped-query attention of each query over shared context keys (where ctx_mask [N, M] allows)
    and over its own chain of keys. q [B, heads, N, d]; k_ctx, v_ctx [B, kv heads, M, d];
    k_own, v_own [B, kv heads, N, E, d]; returns [B, N, heads * d]."""
    b, heads, n, d = q.shape
    groups = k_ctx.shape[1]
    q = q.view(b, groups, heads // groups, n, d) * d ** -0.5
    s_ctx = (q @ k_ctx.unsqueeze(2).transpose(-1, -2)).masked_fill(~ctx_mask, float("-inf"))
    s_own = torch.einsum("bgrnd,bgned->bgrne", q, k_own)
    p = torch.softmax(torch.cat([s_ctx, s_own], -1).float(), -1).to(v_ctx.dtype)
    m = k_ctx.shape[2]
    out = p[..., :m] @ v_ctx.unsqueeze(2) + torch.einsum("bgrne,bgned->bgrnd", p[..., m:], v_own)
    return out.reshape(b, heads, n, d).transpose(1, 2).reshape(b, n, heads * d)


class EagleHead(nn.Module):
    """fc + one Llama decoder layer + optional RMSNorm + reduced lm_head (see the module docstring)."""

    def __init__(self, layer_config, vocab_rows: int, final_norm: bool, feature_layers: list[int] = ()):
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        super().__init__()
        hidden = layer_config.hidden_size
        self.config = layer_config
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.feature_layers = list(feature_layers)
        self.fuse = nn.Linear((len(feature_layers) + 1) * hidden, hidden, bias=False) if feature_layers else None
        self.layer = LlamaDecoderLayer(layer_config, layer_idx=0)
        self.norm = LlamaRMSNorm(hidden, eps=layer_config.rms_norm_eps) if final_norm else nn.Identity()
        self.lm_head = nn.Linear(hidden, vocab_rows, bias=False)
        self.rotary = LlamaRotaryEmbedding(layer_config)

    def inputs(self, token_embeds, feats):
        return self.fc(torch.cat([token_embeds, feats], -1))

    def fused(self, features):
        """The target's features as the head reads them: f_t, or with fused features fuse([rms(h_a);
        ...; f_t]) over the residual streams after `feature_layers` (each scaled to unit RMS) and f_t."""
        if self.fuse is None:
            return features
        *streams, final = features.split(self.config.hidden_size, -1)
        eps = self.config.rms_norm_eps
        streams = [h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) for h in streams]
        return self.fuse(torch.cat([*streams, final], -1))

    def qkv(self, x, positions):
        """Rotated queries [B, heads, N, d] and keys, values [B, kv heads, N, d] of inputs x at positions [N]."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn, (b, n, _) = self.layer.self_attn, x.shape
        h = self.layer.input_layernorm(x)
        split = lambda proj: proj(h).view(b, n, -1, self.config.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, positions.expand(b, -1))
        q, k = apply_rotary_pos_emb(split(attn.q_proj), split(attn.k_proj), cos, sin)
        return q, k, split(attn.v_proj)

    def block(self, x, q, k_ctx, v_ctx, ctx_mask, k_own, v_own):
        """The decoder layer's output f^ for inputs x, given their attention keys."""
        x = x + self.layer.self_attn.o_proj(attention(q, k_ctx, v_ctx, ctx_mask, k_own, v_own))
        return x + self.layer.mlp(self.layer.post_attention_layernorm(x))

    def logits(self, feats):
        return self.lm_head(self.norm(feats))

    def unroll(self, token_embeds, feats, depth: int, next_embeds=None) -> list[torch.Tensor]:
        """f^ of depths 1..depth from every position n of [B, N] true inputs (embed(x_{n+1}), f_n), as
        chained drafting computes them: depth 1 reads those (causally; feats as the feature pool holds
        them, see fused); depth d + 1 reads the head's own
        f^ of depth d and next_embeds(d, that f^), the embedding of x_{n+1+d} (the true token in training,
        the head's greedy draft of depth d in drafting), at position n + d, attending over the true keys
        before n and over its own chain, whose first key (at n) is the true one. Returns `depth` tensors
        [B, N - d, H]: the d-th (from 0) at n is f^_{n+1+d}."""
        x = self.inputs(token_embeds, self.fused(feats))
        n = x.shape[1]
        positions = torch.arange(n, device=x.device)
        ctx_mask = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)
        q, k_ctx, v_ctx = self.qkv(x, positions)
        own_k, own_v, out = [k_ctx], [v_ctx], []
        for d in range(depth):
            if d:
                rows, prev = n - d, out[-1][:, :n - d]
                x = self.inputs(next_embeds(d, prev), prev)
                q, key, value = self.qkv(x, positions[:rows] + d)
                own_k = [t[:, :, :rows] for t in own_k] + [key]
                own_v = [t[:, :, :rows] for t in own_v] + [value]
                ctx_mask = ctx_mask[:rows]
            out.append(self.block(x, q, k_ctx, v_ctx, ctx_mask, torch.stack(own_k, -2), torch.stack(own_v, -2)))
        return out


def add_fuse(head: EagleHead, feature_layers: list[int]) -> None:
    """Give a head fused features, fuse starting as [0 ... 0, I]: it reads f_t alone, as before."""
    hidden = head.config.hidden_size
    head.feature_layers = list(feature_layers)
    head.fuse = nn.Linear((len(feature_layers) + 1) * hidden, hidden, bias=False)
    head.fuse.weight.data.zero_()
    head.fuse.weight.data[:, -hidden:] = torch.eye(hidden)


def new_head(target, layer: int, token_ids: torch.Tensor, final_norm: bool, fc_init: str,
             feature_layers: list[int] = ()) -> EagleHead:
    """The head with target layer `layer`'s weights, lm_head rows = the target's embedding rows token_ids
    and (with final_norm) the target's final norm weight; fc_init "sum" starts fc at
    x = f_t + s * embed(x_{t+1}), s = rms(final norm weight) / rms(embedding) (the parts at similar scale),
    "random" at nn.Linear's initialisation; with feature_layers, fuse starts reading f_t alone (add_fuse)."""
    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = 1
    head = EagleHead(config, len(token_ids), final_norm)
    if feature_layers:
        add_fuse(head, feature_layers)
    prefix = f"model.layers.{layer}."
    head.layer.load_state_dict({k[len(prefix):]: v.float().cpu() for k, v in target.state_dict().items()
                                if k.startswith(prefix)})
    head.lm_head.weight.data.copy_(target.get_input_embeddings().weight.detach().cpu()[token_ids.cpu()])
    if final_norm:
        head.norm.load_state_dict(target.model.norm.state_dict())
    if fc_init == "sum":
        rms = lambda w: w.detach().float().pow(2).mean().sqrt().cpu()
        eye = torch.eye(config.hidden_size)
        scale = rms(target.model.norm.weight) / rms(target.get_input_embeddings().weight)
        head.fc.weight.data.copy_(torch.cat([scale * eye, eye], 1))
        head.fc.bias.data.zero_()
    return head


def save_head(head: EagleHead, token_ids: torch.Tensor, out: Path, layer: int) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    save_file({"token_ids": token_ids.to("cpu", torch.int64).contiguous()}, out / "draft_vocab.safetensors")
    config = {
        "architecture": "eagle_head", "hidden_size": head.config.hidden_size, "draft_vocab_size": len(token_ids),
        "fc": {"in_features": 2 * head.config.hidden_size, "out_features": head.config.hidden_size, "bias": True,
               "input": "concat(target.embed_tokens(x[t+1]), target final normed hidden f[t])"
                        + (", f[t] replaced by fuse(concat(rms(h_l[t]) for l in feature_layers, f[t])) where h_l "
                           "is the residual stream after target layer l" if head.fuse is not None else "")},
        "feature_layers": head.feature_layers,
        "final_norm": not isinstance(head.norm, nn.Identity), "layer_initialised_from_target_layer": layer,
        "position_ids": "the input at t (f[t], x[t+1]) has position t; it drafts x[t+2]",
        "output": "f^[t+1] (trained to match f[t+1], fed back as f in chained drafting); logits = lm_head(norm(f^))",
        "decoder_layer": head.config.to_dict()}
    (out / "config.json").write_text(json.dumps(config, indent=1))


def load_head(out: Path) -> tuple[EagleHead, torch.Tensor]:
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    config = json.loads((out / "config.json").read_text())
    token_ids = load_file(out / "draft_vocab.safetensors")["token_ids"]
    head = EagleHead(LlamaConfig.from_dict(config["decoder_layer"]), len(token_ids), config["final_norm"],
                     config.get("feature_layers", []))
    head.load_state_dict({k: v.float() for k, v in load_file(out / "model.safetensors").items()})
    return head.eval(), token_ids
