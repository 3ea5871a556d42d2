"""Train an EAGLE-style draft head (Li et al. 2024, arXiv 2401.15077) for the default target,
SmolLM2-135M-Instruct, on this machine's CPU, and measure what it would buy a speculative engine.

The head, at position t, reads the target's final normed hidden state f_t (HF's last_hidden_state)
and the target's frozen embedding of the next token x_{t+1}:
    x      = fc([embed(x_{t+1}); f_t])          1152 -> 576, with bias
    f^_t+1 = one Llama decoder layer (x)        initialised from target layer `--layer`
    logits = lm_head(norm(f^_t+1))              8,192 rows (select_vocab of train_default_draft.py),
                                                initialised from the target's embedding rows;
                                                norm = an RMSNorm with `--final-norm` (initialised
                                                from the target's final norm), else none
and drafts x_{t+2}. Its decoder layer attends over its own keys at the earlier positions, whose inputs
are the true (x, f) pairs; the head's position id for the input at t is t (the position of f_t), so
an engine keeps a head KV cache aligned with the target's positions. Chained drafting feeds the head
its own f^ and greedy token: draft 2 reads [embed(d_1); f^_{t+1}] at position t + 1, and so on.

Loss on the answer positions: smooth-L1(f^_{t+1}, f_{t+1}) + `--ce-weight` x (soft CE to the teacher's
top-32 at t + 1, restricted to the draft vocabulary, + `--hard` x CE on its argmax), i.e.
train_default_draft.distil_loss on the shifted positions. `--ttt D` also unrolls D more depths as
chained drafting does, on the head's own f^ with the true next tokens (training-time test, EAGLE-3,
arXiv 2503.01840): depth d + 1 from n is scored against the teacher at n + 1 + d; the losses add.

`--feature-layers 2,15,27` gives the head fused features (EAGLE-3): f_t above is replaced by
fuse([rms(h_2,t); rms(h_15,t); rms(h_27,t); f_t]) over the residual streams after those target layers
(the logits stage must have kept them: its `--feature-layers`); chained drafts still read f^. With
`--init`, a head without fuse gains one that starts as [0, 0, 0, I], so training starts from exactly
the saved head's drafts (perf/results/default_models.md: within 20 minutes on one thread, no gain
over the same continuation without them).

Data: train_default_draft's data.pt and teacher.pt (the teacher's top-32 and hidden states).

Held-out (the prompts of scripts/chat_prompts.HELDOUT; float32 target, cached in heldout.pt):
  sampled  data.pt's T = 0.7 answers, as train_default_draft's HeldOut: step-1 greedy agreement
           with the target's argmax and expected acceptance sum_x min(p, q) at T = 0.7
  greedy   the float32 target's greedy answers (up to 160 tokens): chained drafting with k
           drafts from every answer position, accepted = consecutive matches with the greedy text
           (0..k), and the acceptance rate at each depth given the earlier ones accepted
Also timed (batch 1, 128 cached tokens, `--threads` threads, medians): one head forward, one target
forward of 1 and of k + 1 query tokens. `--baseline` adds the chained figures of a saved standalone
draft (train_default_draft.load_draft).

Saved to `--out`: config.json, model.safetensors (bfloat16), draft_vocab.safetensors (`token_ids`,
int64 ascending) and train_result.json; the summary goes to `--result`.

The shipped head (model_repository/llm_engine/1/eagle) was trained on 2 cores in two runs, after
scripts/train_default_draft.py's data and logits stages (its docstring), 25 + 10 minutes:

    python -m scripts.train_eagle_draft --threads 2 --minutes 25 --eval-every 400 \
        --out .cache/eagle_draft/head --result .cache/eagle_draft/result.json
    python -m scripts.train_eagle_draft --threads 2 --init .cache/eagle_draft/head --ttt 1 --lr 2e-3 \
        --minutes 10 --eval-every 300 --out .cache/eagle_draft/head_ttt --result .cache/eagle_draft/result_ttt.json
    cp .cache/eagle_draft/head_ttt/{config.json,model.safetensors,draft_vocab.safetensors,train_result.json} \
        model_repository/llm_engine/1/eagle/

(held-out step-1 agreement 0.506 after the first run, 0.494 after the second, whose chained drafts
survive much longer: 0.92 of k = 3 accepted per step against 0.77).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from perf.harness import sync
from scripts.chat_prompts import HELDOUT_CHAT
from scripts.train_default_draft import (
    CACHE,
    REPO_ROOT,
    bf16_autocast,
    distil_loss,
    load_draft,
    load_target,
    select_vocab,
    target_hidden,
    train_batches,
)

OUT = REPO_ROOT / ".cache" / "eagle_draft"
TEMPERATURE = 0.7
MAX_ANSWER_TOKENS = 160
CONTEXT = 128  # cached tokens in the timings


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


def target_answers(tok, target, prompts: list[list[int]], batch: int = 8, max_new_tokens: int = MAX_ANSWER_TOKENS,
                   **sampling) -> list[list[int]]:
    """The float32 target's answers (left-padded batches; cut after the first eos): greedy, or as
    `sampling` (generate's do_sample, temperature, ...) says."""
    answers = []
    for b in range(0, len(prompts), batch):
        rows = prompts[b:b + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in rows], device=target.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=target.device)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              pad_token_id=tok.pad_token_id, **({"do_sample": False} | sampling))
        for row in out[:, width:].tolist():
            answers.append(row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return answers


def target_item(target, ids: list[int], start: int, token_ids: torch.Tensor | None, feature_layers: list[int]) -> dict:
    """A sequence with the float32 target's features (as the feature pool holds them: the residual stream
    after each of feature_layers and the final normed hidden state, concatenated) and argmaxes at every
    position, and (given token_ids) its T = 0.7 probabilities of the draft tokens."""
    input_ids = torch.tensor([ids], device=target.device)
    hidden, layers = target_hidden(target, input_ids, feature_layers)
    hidden = hidden[0]
    logits = target.lm_head(hidden)
    p = None if token_ids is None else F.softmax(logits / TEMPERATURE, -1)[:, token_ids].half()
    features = hidden if layers is None else torch.cat([layers[0].flatten(1), hidden], -1)
    return {"ids": input_ids[0], "start": start, "hidden": features, "argmax": logits.argmax(-1), "p": p}


@torch.inference_mode()
def heldout_sets(tok, target, data: dict, token_ids: torch.Tensor,
                 feature_layers: list[int]) -> tuple[list[dict], list[dict]]:
    """(sampled, greedy) held-out items, chat prompts first, on the target's device; computed once into
    heldout.pt (heldout_l2-15.pt with feature_layers 2, 15)."""
    path = OUT / ("heldout.pt" if not feature_layers else f"heldout_l{'-'.join(map(str, feature_layers))}.pt")
    if path.exists():
        cached = torch.load(path)
        if torch.equal(cached["token_ids"], token_ids.cpu()) and cached.get("feature_layers", []) == feature_layers:
            return to_device(cached["sampled"], target.device), to_device(cached["greedy"], target.device)
    sampled = [target_item(target, ids, start, token_ids, feature_layers) for ids, start in data["heldout"]]
    prompts = [ids[:start] for ids, start in data["heldout"]]
    greedy = [target_item(target, p + a, len(p), None, feature_layers)
              for p, a in zip(prompts, target_answers(tok, target, prompts))]
    mismatch = sum((g["argmax"][g["start"] - 1:-1] != g["ids"][g["start"]:]).sum().item() for g in greedy)
    print(f"greedy held-out: {sum(len(g['ids']) - g['start'] for g in greedy)} answer tokens, "
          f"{mismatch} differ from the unpadded forward's argmax", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    torch.save({"token_ids": token_ids.cpu(), "feature_layers": feature_layers, "sampled": to_device(sampled, "cpu"),
                "greedy": to_device(greedy, "cpu")}, path)
    return sampled, greedy


def to_device(items: list[dict], device) -> list[dict]:
    """Held-out items with their tensors on `device`."""
    return [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in it.items()} for it in items]


def splits(items: list[dict]) -> dict[str, list[dict]]:
    chat = len(HELDOUT_CHAT)
    return {"all": items, "chat": items[:chat], "code": items[chat:]}


def answer_drafts(head: EagleHead, embed, it: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Step-1 drafting of an item's answer with true features: (the head's f^ [n, H] whose logits
    draft each answer token, the target's argmax there [n], its T = 0.7 p there [n, V'] or None)."""
    ids, j = it["ids"], slice(it["start"] - 1, len(it["ids"]) - 1)  # target positions predicting answers
    feats = head.unroll(embed(ids[None, 1:]), it["hidden"][None, :-1], 1)[0][0]  # head position t = j - 1
    return feats[it["start"] - 2:-1], it["argmax"][j], None if it["p"] is None else it["p"][j].float()


@torch.inference_mode()
def step1(head: EagleHead, embed, items: list[dict], token_ids: torch.Tensor) -> dict:
    """Greedy agreement and expected acceptance at T = 0.7 with true features, at the answer positions."""
    result = {}
    for name, subset in splits(items).items():
        agree = accept = count = 0.0
        for it in subset:
            feats, argmax, p = answer_drafts(head, embed, it)
            q_logits = head.logits(feats).float()
            agree += (token_ids[q_logits.argmax(-1)] == argmax).sum().item()
            accept += torch.minimum(p, F.softmax(q_logits / TEMPERATURE, -1)).sum().item()
            count += len(q_logits)
        result[name] = {"agreement": agree / count, "acceptance": accept / count}
    return result


@torch.inference_mode()
def head_chain(head: EagleHead, embed, it: dict, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Greedy drafts [k, N] from every head position n (N = L - 1): row d drafts ids[n + 2 + d] (-1 past
    the text), draft 1 from the true f_n, the later ones from the head's own f^ and greedy token."""
    ids = it["ids"]
    greedy = lambda feats: token_ids[head.logits(feats).argmax(-1)]
    out = head.unroll(embed(ids[None, 1:]), it["hidden"][None, :-1], k, lambda d, feats: embed(greedy(feats)))
    drafts = torch.full((k, len(ids) - 1), -1, device=ids.device)
    for d, feats in enumerate(out):
        drafts[d, :feats.shape[1]] = greedy(feats[0])
    return drafts


@torch.inference_mode()
def standalone_chain(draft, it: dict, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """The standalone draft's greedy drafts [k, N] from every position j (N = L - 1): row d drafts
    ids[j + 1 + d]; a chain stops (drafts -1) after its first miss, which decides its acceptance."""
    from transformers import DynamicCache

    ids = it["ids"]
    out = draft(ids[None], use_cache=True)
    drafts = torch.full((k, len(ids) - 1), -1, device=ids.device)
    drafts[0] = token_ids[out.logits[0, :-1].argmax(-1)]
    for j in range(it["start"] - 1, len(ids) - k):
        cache = DynamicCache([(layer.keys[..., :j + 1, :], layer.values[..., :j + 1, :]) for layer in out.cache.layers])
        for depth in range(1, k):
            if drafts[depth - 1, j] != ids[j + depth]:
                break
            logits = draft(drafts[depth - 1, j].view(1, 1), cache=cache, use_cache=True).logits[0, -1]
            drafts[depth, j] = token_ids[logits.argmax()]
    return drafts


def chain_metrics(items: list[dict], drafts: list[torch.Tensor], offset: int, k: int) -> dict:
    """Expected accepted drafts per verification (0..k) under greedy, and the acceptance rate at each
    depth given the earlier ones accepted; drafts[i][d, n] drafts ids[n + offset + d] (offset 1 for a
    standalone draft's position j = n, 2 for the head's position t = n), from the answer positions."""
    result = {}
    chat = len(HELDOUT_CHAT)
    for name, rows in {"all": slice(None), "chat": slice(0, chat), "code": slice(chat, None)}.items():
        accepted = []
        for it, d in zip(items[rows], drafts[rows]):
            first = it["start"] - 1 - (offset - 1)  # first column whose draft 1 is an answer token
            last = len(it["ids"]) - k - offset  # last column whose k drafts stay inside the text
            truth = torch.stack([it["ids"][first + offset + depth:last + offset + depth + 1] for depth in range(k)])
            accepted.append((d[:, first:last + 1] == truth).int().cumprod(0).sum(0))
        accepted = torch.cat(accepted)
        reach = [(accepted >= depth).sum().item() for depth in range(k + 1)]
        result[name] = {"expected_accepted": accepted.float().mean().item(), "positions": len(accepted),
                        "depth_rates": [reach[d + 1] / max(reach[d], 1) for d in range(k)]}
    return result


def evaluate(head, embed, sampled, greedy, token_ids, k: int, label: str) -> dict:
    result = {"step1": step1(head, embed, sampled, token_ids),
              "chain": chain_metrics(greedy, [head_chain(head, embed, it, token_ids, k) for it in greedy], 2, k)}
    print(f"held-out {label}: " + ", ".join(f"{s} {m['agreement']:.3f}/{m['acceptance']:.3f}"
                                            for s, m in result["step1"].items())
          + f" (step-1 agreement/acceptance); k={k} greedy accepted " + ", ".join(
              f"{s} {m['expected_accepted']:.3f} {[round(r, 3) for r in m['depth_rates']]}"
              for s, m in result["chain"].items()), flush=True)
    return result


def lr_at(args, progress: float) -> float:
    """Linear warm-up over the first 5 %, then cosine down to 5 % of --lr."""
    return args.lr * min(1.0, progress * 20) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_step(head, embed, opt, batch, index, args) -> tuple[int, list[tuple]]:
    """One step on a batch: depth 1 (true inputs) and --ttt more depths unrolled on the head's own f^ and
    the true tokens; depth d's output at position n is scored against the teacher's position n + d, the
    depths' losses summed. Returns (depth-1 positions, each depth's (soft CE, hard CE, smooth-L1))."""
    input_ids, mask, top_ids, top_logp, hidden = batch
    embeds = embed(input_ids)
    final = hidden[..., -head.config.hidden_size:]  # f, the smooth-L1 target (hidden: the pool's features)
    with bf16_autocast(args.device, args.bf16):
        outs = head.unroll(embeds[:, 1:], hidden[:, :-1], 1 + args.ttt, lambda d, feats: embeds[:, 1 + d:])
        sels = [mask[:, 1 + d:] for d in range(len(outs))]
        feats = [out[sel] for out, sel in zip(outs, sels)]
        logits = [head.logits(f) for f in feats]
    total, parts = 0.0, []
    for d, (f, lg, sel) in enumerate(zip(feats, logits, sels)):
        loss, part = distil_loss(lg, f, torch.ones(len(f), dtype=torch.bool, device=f.device), top_ids[:, 1 + d:][sel],
                                 top_logp[:, 1 + d:][sel], final[:, 1 + d:][sel], index, args.hard, 1 / args.ce_weight)
        total, parts = total + args.ce_weight * loss, parts + [part]
    opt.zero_grad(set_to_none=True)
    total.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()
    return int(sels[0].sum()), parts


def train(head, embed, data, teacher, index, sampled, greedy, token_ids, pad: int, args) -> dict:
    """Trains for --minutes (or until --patience evaluations bring no step-1 acceptance gain of 0.002)."""
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    source = train_batches(data, teacher, args.batch_size, args.seed, pad, head.feature_layers)
    history, best, stale = [], -1.0, 0
    start, step, tokens, train_s = time.monotonic(), 0, 0, 0.0
    deadline = start + args.minutes * 60
    while time.monotonic() < deadline and (not args.patience or stale < args.patience):
        batch = [t.to(args.device) for t in next(source)]
        tick = time.monotonic()
        for group in opt.param_groups:
            group["lr"] = lr_at(args, (tick - start) / (deadline - start))
        n, parts = train_step(head, embed, opt, batch, index, args)
        train_s += time.monotonic() - tick
        step, tokens = step + 1, tokens + n
        if step % 50 == 0:
            print(f"step {step}: " + "; ".join(f"depth {d + 1} soft CE {p[0]:.3f}, hard CE {p[1]:.3f}, smooth-L1 "
                                                f"{p[2]:.4f}" for d, p in enumerate(parts))
                  + f"; {tokens / train_s:.0f} trained tok/s, {(time.monotonic() - start) / 60:.1f} min", flush=True)
        if step % args.eval_every == 0:
            result = evaluate(head, embed, sampled, greedy, token_ids, args.k, f"step {step}")
            history.append(dict(step=step, minutes=(time.monotonic() - start) / 60, tokens=tokens, **result))
            score = result["step1"]["all"]["acceptance"]
            best, stale = (score, 0) if score > best + 0.002 else (best, stale + 1)
    minutes = (time.monotonic() - start) / 60
    print(f"trained {step} steps, {tokens} tokens, {minutes:.1f} min ({tokens / max(train_s, 1e-9):.0f} tok/s "
          "in the training steps)", flush=True)
    return {"steps": step, "tokens": tokens, "minutes": minutes,
            "train_step_tokens_per_s": tokens / max(train_s, 1e-9), "history": history}


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


def standalone(draft, token_ids: torch.Tensor, path: Path, greedy: list[dict], k: int) -> dict:
    """The saved standalone draft's step-1 figures (its train_result.json) and chained ones."""
    reported = json.loads((path / "train_result.json").read_text())["heldout"]
    chains = [standalone_chain(draft, it, token_ids, k) for it in greedy]
    return {"path": str(path), "step1_reported": reported, "chain": chain_metrics(greedy, chains, 1, k)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--out", default=str(OUT / "head"))
    ap.add_argument("--result", default=str(OUT / "result.json"))
    ap.add_argument("--layer", type=int, default=29, help="target layer that initialises the head's")
    ap.add_argument("--final-norm", action=argparse.BooleanOptionalAction, default=True,
                    help="an RMSNorm before the lm_head (without it training starts far off)")
    ap.add_argument("--fc-init", choices=("random", "sum"), default="sum", help="see new_head")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ce-weight", type=float, default=1.0, help="w: loss = smooth-L1 + w x (soft CE + hard x CE)")
    ap.add_argument("--hard", type=float, default=0.0, help="weight of CE on the teacher's argmax, inside w")
    ap.add_argument("--bf16", action="store_true",
                    help="bfloat16 autocast in training (on a CPU without native bfloat16, slower than float32)")
    ap.add_argument("--ttt", type=int, default=0, help="extra depths trained on the head's own features")
    ap.add_argument("--init", default="", help="a saved head to continue training (instead of a new one)")
    ap.add_argument("--feature-layers", default="",
                    help="fused features (EAGLE-3, arXiv 2503.01840): also read the residual stream after these target "
                         "layers (a subset of the logits stage's --feature-layers); with --init, a head without them "
                         "gains a fuse layer that starts as reading f alone")
    ap.add_argument("--k", type=int, default=3, help="drafts per verification in the chained measurement")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--patience", type=int, default=0, help="stop after this many evaluations without gain (0: off)")
    ap.add_argument("--baseline", default="", help="a saved standalone draft to measure chained, too")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the target and the head run: cpu, or cuda (a GPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tok, target = load_target(torch.float32, args.device)
    embed = copy.deepcopy(target.get_input_embeddings()).requires_grad_(False)
    data, teacher = torch.load(CACHE / "data.pt"), torch.load(CACHE / "teacher.pt")
    vocab = target.config.vocab_size
    feature_layers = [int(x) for x in args.feature_layers.split(",") if x]
    if args.init:  # continue training a saved head; its config decides the architecture and vocabulary
        head, token_ids = load_head(Path(args.init))
        args.layer = json.loads((Path(args.init) / "config.json").read_text())["layer_initialised_from_target_layer"]
        if feature_layers and head.fuse is None:
            add_fuse(head, feature_layers)
    else:
        token_ids = select_vocab(data, teacher, args.draft_vocab, vocab)
        head = new_head(target, args.layer, token_ids, args.final_norm, args.fc_init, feature_layers)
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[token_ids] = torch.arange(len(token_ids))
    head, token_ids, index = head.to(args.device), token_ids.to(args.device), index.to(args.device)
    sampled, greedy = heldout_sets(tok, target, data, token_ids, head.feature_layers)
    summary, draft = {"args": vars(args)}, None
    if args.baseline:
        draft, draft_ids = load_draft(Path(args.baseline), target)
        summary["standalone"] = standalone(draft, draft_ids, Path(args.baseline), greedy, args.k)
        print(f"standalone {args.baseline}: k={args.k} greedy chain {summary['standalone']['chain']}", flush=True)

    summary["before"] = evaluate(head, embed, sampled, greedy, token_ids, args.k, "before training")
    summary["training"] = train(head, embed, data, teacher, index, sampled, greedy, token_ids, tok.pad_token_id, args)
    out = Path(args.out)
    save_head(head, token_ids, out, args.layer)
    reloaded = load_head(out)[0].to(args.device)
    summary["after"] = evaluate(reloaded, embed, sampled, greedy, token_ids, args.k, f"after training (saved, {out})")
    summary["timings"] = t = timings(target, reloaded, embed, token_ids, args.k, draft)
    summary["speedup"] = speedup(summary["after"]["chain"]["all"]["expected_accepted"], args.k, t["c"], t["verify_cost"])
    if args.baseline:
        summary["standalone"]["speedup"] = speedup(
            summary["standalone"]["chain"]["all"]["expected_accepted"], args.k, t["standalone_c"], t["verify_cost"])
    print(f"speedup: {summary['speedup']}", flush=True)
    (out / "train_result.json").write_text(json.dumps(summary, indent=1))
    Path(args.result).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
