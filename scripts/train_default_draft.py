"""Distil a draft model for the default target, SmolLM2-135M-Instruct, on this machine's CPU.

The draft is a standard HF Llama with the target's tokenizer, width and heads, and two departures:
  * `--layers` decoder layers, initialised from those target layers (default 0,1), and the target's
    final norm, all trained;
  * input embedding = the target's (frozen, NOT saved: the engine takes it from the target), and a
    reduced lm_head of V' = `--draft-vocab` rows (FR-Spec, 2025): the V' most frequent
    tokens of the training answers, code windows and the teacher's argmaxes, initialised from the
    target's embedding rows and trained. The draft's probability is zero outside those tokens;
    draft_vocab.safetensors maps draft row i -> target token id (`token_ids`, int64 [V'], ascending).
    config.json keeps vocab_size = the target's (the embedding's) and adds draft_vocab_size = V'.

Training text:
  chat   the target's own answers (T = 0.7, seeded, this engine in `--teacher-dtype`) to
         scripts/chat_prompts.training_prompts(), whose topics the held-out prompts do not use
  magpie the target's answers (T = 0.7, every 5th greedy) to prompts the target wrote itself
         (scripts/magpie_prompts.py; `--num-magpie`, none by default)
  code   windows of Python standard-library files (scripts/python_corpus.py)
The teacher's outputs are computed once (`logits` stage, `--teacher-dtype`): at every position the
top-`--top-k` log-probabilities, the final normed hidden state and, with `--feature-layers`, the
residual stream after those layers (an EAGLE head's fused features, scripts/train_eagle_draft.py). The loss is soft CE to the
teacher's top-k restricted to the draft vocabulary (renormalised, = KL up to a constant), + `--hard`
x CE on the teacher's argmax, + `--feature` x smooth-L1 between draft and teacher final hidden states.

Every stage runs where `--device` says: the CPU by default, or `cuda` (the engine's answers, the
teacher's forwards and the training on a GPU, for data many times this size in minutes).

Stages (``--stage``, a comma list):
  teacher  measures what a position of data costs here, per dtype: the target's generation tok/s
           (data) and teacher-forced forward tok/s (logits), and estimates the data stage's CPU time
  data     generates the held-out answers (HELDOUT, T = 0.7), cuts the code windows, generates the
           chat answers and, with `--num-magpie`, the Magpie answers -> .cache/default_draft/data.pt;
           a rerun keeps what data.pt already holds (see draft_data.stage_data) and generates only the rest
  logits   the teacher's top-k and hidden states on every training sequence -> teacher.pt
  train    distils for `--minutes`, reports greedy agreement and expected acceptance sum_x min(p, q)
           at T = 0.7 (Leviathan et al. 2023, arXiv 2211.17192; q scattered to the full vocabulary)
           on the float32 target's distributions over its answers to the held-out prompts (chat and
           code separately, never trained on), before, during (`--eval-every`) and after, then
           saves to `--out`: config.json, model.safetensors (bfloat16, no model.embed_tokens),
           draft_vocab.safetensors, the target's tokenizer files and train_result.json

    # the data of the shipped EAGLE head (scripts/train_eagle_draft.py), on 2 cores: ~40 minutes
    python -m scripts.magpie_prompts --num-samples 4096 --chunk 1024 --max-num-seqs 256 --dtype bfloat16 \
        --threads 2                                  # 3,180 prompts kept
    python -m scripts.train_default_draft --stage data --teacher-dtype float32 --threads 2 --num-chat 680 \
        --num-code-windows 600                       # held-out and 670 chat answers: ~7 min
    python -m scripts.train_default_draft --stage data --teacher-dtype bfloat16 --threads 2 --num-chat 680 \
        --num-code-windows 600 --num-magpie 3180 --magpie-chunk 800 --magpie-answer-tokens 160   # ~18 min
    python -m scripts.train_default_draft --stage logits --teacher-dtype bfloat16 --threads 2 \
        --feature-layers 2,15,27                     # 906k positions: ~8 min (and the fused features' streams)
    # a standalone draft on the same data
    python -m scripts.train_default_draft --stage train --layers 0,1 --draft-vocab 8192 \
        --batch-size 8 --lr 1e-3 --minutes 38 --eval-every 250 --out .cache/default_draft/best
    python -m scripts.draft_bench --threads 2     # batch-1 draft / target forward time
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from scripts.default_target import bf16_autocast, load_target, target_hidden
from scripts.draft_data import CACHE, SEQ_LEN, TRAIN_SPLITS, padded, stage_data, stage_teacher
from scripts.draft_model import load_draft, new_draft, save_draft


@torch.inference_mode()
def stage_logits(args) -> None:
    """The target's outputs on every training sequence, once (in `--teacher-dtype`: float32, or bfloat16
    autocast): at each position the top-`--top-k` log-probabilities (T = 1) with their token ids, the
    final (normed) hidden state and, with `--feature-layers`, the residual stream after each of those
    layers (for an EAGLE head with fused features; all stored in bfloat16)."""
    tok, target = load_target(torch.float32, args.device)
    data = torch.load(CACHE / "data.pt")
    feature_layers = [int(x) for x in args.feature_layers.split(",") if x]
    cache, start = {"feature_layers": feature_layers}, time.monotonic()
    for split in TRAIN_SPLITS:
        seqs = [(ids[:SEQ_LEN], s) for ids, s in data.get(split, [])]
        out: list[dict | None] = [None] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
        for b in range(0, len(order), args.batch_size):
            rows = order[b:b + args.batch_size]
            input_ids, _ = padded([seqs[i] for i in rows], tok.pad_token_id)
            with bf16_autocast(args.device, args.teacher_dtype == "bfloat16"):
                hidden, layers = target_hidden(target, input_ids.to(args.device), feature_layers)
                logp = F.log_softmax(target.lm_head(hidden).float(), -1)
            top = logp.topk(args.top_k, -1)
            top_ids, top_logp, hidden = top.indices.cpu(), top.values.cpu(), hidden.cpu()
            layers = layers.cpu() if layers is not None else None
            for r, i in enumerate(rows):
                n = len(seqs[i][0])
                out[i] = dict(ids=top_ids[r, :n].int(), logp=top_logp[r, :n].half(),
                              hidden=hidden[r, :n].to(torch.bfloat16))
                if layers is not None:
                    out[i]["layers"] = layers[r, :n].to(torch.bfloat16)
        cache[split] = out
        print(f"teacher outputs, {split}: {sum(len(s[0]) for s in seqs)} positions, "
              f"{(time.monotonic() - start) / 60:.1f} min", flush=True)
    torch.save(cache, CACHE / "teacher.pt")
    print(f"saved {CACHE / 'teacher.pt'}")


def select_vocab(data: dict, teacher: dict, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent tokens (ascending ids) among the training answers' tokens, the code
    windows' tokens and the teacher's argmax at every loss position (FR-Spec, 2025)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for split in TRAIN_SPLITS:
        for (ids, start), t in zip(data.get(split, []), teacher.get(split, [])):
            ids = ids[:SEQ_LEN]
            counts += torch.bincount(torch.tensor(ids[max(start, 1):]), minlength=vocab_size)
            counts += torch.bincount(t["ids"][max(start - 1, 0):len(ids) - 1, 0].long(), minlength=vocab_size)
    if size >= vocab_size:
        return torch.arange(vocab_size)
    return counts.topk(size).indices.sort().values


class HeldOut:
    """The held-out sequences with the float32 target's distributions at T = 0.7 at their loss positions."""

    def __init__(self, target, sequences, pad: int, temperature: float = 0.7):
        self.items = []
        with torch.inference_mode():
            for ids, start in sequences:
                input_ids, mask = (t.to(target.device) for t in padded([(ids, start)], pad))
                logits = target(input_ids).logits.float()[mask]
                self.items.append((input_ids, mask, logits.argmax(-1), F.softmax(logits / temperature, -1).half()))
        self.temperature = temperature

    @torch.inference_mode()
    def evaluate(self, draft, token_ids: torch.Tensor, subset: slice = slice(None)) -> tuple[float, float]:
        """(greedy agreement, expected acceptance sum_x min(p, q)) with q zero outside token_ids."""
        agree = accept = count = 0.0
        for input_ids, mask, p_argmax, p in self.items[subset]:
            q_logits = draft(input_ids).logits.float()[mask]
            agree += (token_ids[q_logits.argmax(-1)] == p_argmax).sum().item()
            q = F.softmax(q_logits / self.temperature, -1)
            accept += torch.minimum(p[:, token_ids].float(), q).sum().item()
            count += len(p_argmax)
        return agree / count, accept / count

    def report(self, draft, token_ids: torch.Tensor, label: str) -> dict:
        half = len(self.items) // 2  # HELDOUT = HELDOUT_CHAT + HELDOUT_CODE
        result = dict(all=self.evaluate(draft, token_ids), chat=self.evaluate(draft, token_ids, slice(0, half)),
                      code=self.evaluate(draft, token_ids, slice(half, None)))
        print(f"held-out {label}: " + ", ".join(f"{k} agreement {a:.3f} acceptance {c:.3f}"
                                                for k, (a, c) in result.items()), flush=True)
        return result


def train_batches(data: dict, teacher: dict, batch_size: int, seed: int, pad: int, feature_layers: list[int] = ()):
    """Endless shuffled batches of similar lengths: (input_ids, mask, top ids, top logp, hidden). With
    `feature_layers` (a subset of the teacher's), hidden is the residual stream after each of those
    layers and then the final normed state, concatenated [B, T, (len + 1) H], as an engine's feature
    pool holds it for an EAGLE head with fused features."""
    pick = [teacher.get("feature_layers", []).index(i) for i in feature_layers]
    items = [((ids[:SEQ_LEN], s), t) for split in TRAIN_SPLITS
             for (ids, s), t in zip(data.get(split, []), teacher.get(split, []))]
    rng = random.Random(seed)
    while True:
        rng.shuffle(items)
        chunks = [sorted(items[i:i + batch_size * 16], key=lambda x: len(x[0][0]))
                  for i in range(0, len(items), batch_size * 16)]
        batches_ = [c[j:j + batch_size] for c in chunks for j in range(0, len(c), batch_size)]
        rng.shuffle(batches_)
        for chunk in batches_:
            input_ids, mask = padded([s for s, _ in chunk], pad)
            length = input_ids.shape[1]
            k, h = chunk[0][1]["ids"].shape[1], chunk[0][1]["hidden"].shape[1]
            top_ids = torch.zeros(len(chunk), length, k, dtype=torch.long)
            top_logp = torch.full((len(chunk), length, k), -1e4)
            hidden = torch.zeros(len(chunk), length, (len(pick) + 1) * h)
            for row, (_, t) in enumerate(chunk):
                n = len(t["ids"])
                top_ids[row, :n], top_logp[row, :n], hidden[row, :n, -h:] = t["ids"], t["logp"].float(), t["hidden"].float()
                if pick:
                    hidden[row, :n, :-h] = t["layers"][:, pick].flatten(1).float()
            yield input_ids, mask, top_ids, top_logp, hidden


def distil_loss(logits, hidden_d, mask, top_ids, top_logp, hidden_t, index, hard: float, feature: float):
    """Soft CE to the teacher's top-k restricted to the draft vocabulary (renormalised), plus `hard` x CE
    on the teacher's argmax where it is in the vocabulary, plus `feature` x smooth-L1 to the teacher's
    final hidden state. index: [vocab] target id -> draft row, -1 outside."""
    q_log = F.log_softmax(logits.float(), -1)[mask]  # [N, V']
    rows = index[top_ids[mask]]  # [N, k]
    inside = rows >= 0
    p = top_logp[mask].exp().masked_fill(~inside, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-8)
    q_top = q_log.gather(-1, rows.clamp(min=0))
    soft = -(p * q_top).sum(-1).mean()
    hard_ok = inside[:, 0]
    hard_ce = -(q_top[:, 0] * hard_ok).sum() / hard_ok.sum().clamp(min=1)
    feat = F.smooth_l1_loss(hidden_d.float()[mask], hidden_t[mask])
    return soft + hard * hard_ce + feature * feat, (soft.item(), hard_ce.item(), feat.item())


def stage_train(args) -> None:
    torch.manual_seed(args.seed)
    tok, target = load_target(torch.float32, args.device)
    data, teacher = torch.load(CACHE / "data.pt"), torch.load(CACHE / "teacher.pt")
    layers = [int(x) for x in args.layers.split(",")]
    vocab = target.config.vocab_size
    token_ids = select_vocab(data, teacher, args.draft_vocab, vocab)
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[token_ids] = torch.arange(len(token_ids))
    token_ids, index = token_ids.to(args.device), index.to(args.device)
    heldout = HeldOut(target, data["heldout"], tok.pad_token_id)
    coverage = sum((index[a] >= 0).sum().item() for _, _, a, _ in heldout.items) / sum(len(a) for _, _, a, _ in heldout.items)
    print(f"draft vocabulary {len(token_ids)}: covers {coverage:.3f} of the held-out target argmaxes")
    draft = new_draft(target, layers, token_ids)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    print(f"draft: layers {layers} of the target, {sum(p.numel() for p in trainable) / 1e6:.2f}M trained parameters")
    heldout.report(draft.eval(), token_ids, "before training")
    head = [draft.lm_head.weight]
    body = [p for p in trainable if p is not draft.lm_head.weight]
    opt = torch.optim.AdamW([dict(params=body), dict(params=head)], lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    source = train_batches(data, teacher, args.batch_size, args.seed, tok.pad_token_id)
    draft.train()
    start, step, tokens = time.monotonic(), 0, 0
    deadline = start + args.minutes * 60
    while time.monotonic() < deadline:
        input_ids, mask, top_ids, top_logp, hidden_t = (t.to(args.device) for t in next(source))
        progress = (time.monotonic() - start) / (deadline - start)
        lr = args.lr * min(1.0, progress * 20) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
        opt.param_groups[0]["lr"], opt.param_groups[1]["lr"] = lr, lr * args.head_lr_scale
        with bf16_autocast(args.device):
            hidden_d = draft.model(input_ids).last_hidden_state
            logits = draft.lm_head(hidden_d)
        loss, parts = distil_loss(logits, hidden_d, mask, top_ids, top_logp, hidden_t, index, args.hard, args.feature)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step += 1
        tokens += int(mask.sum())
        if step % 50 == 0:
            elapsed = time.monotonic() - start
            print(f"step {step}: soft CE {parts[0]:.3f}, hard CE {parts[1]:.3f}, feature {parts[2]:.4f}, "
                  f"{tokens / elapsed:.0f} trained tok/s, {elapsed / 60:.1f} min", flush=True)
        if args.eval_every and step % args.eval_every == 0:
            heldout.report(draft.eval(), token_ids, f"step {step}")
            draft.train()
    print(f"trained {step} steps, {tokens} tokens, {(time.monotonic() - start) / 60:.1f} min")
    out = Path(args.out) if args.out else CACHE / "draft"
    save_draft(draft, token_ids, out)
    reloaded, _ = load_draft(out, target)  # the saved bfloat16 weights, as the engine would load them
    result = heldout.report(reloaded, token_ids, f"after training (saved weights, {out})")
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"saved {out}: {size / 2**20:.1f} MiB of safetensors")
    (out / "train_result.json").write_text(__import__("json").dumps(
        dict(args=vars(args), steps=step, tokens=tokens, heldout=result, vocab_coverage=coverage), indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="teacher")
    ap.add_argument("--layers", default="0,1", help="target layers that initialise the draft's, in order")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="rows of the draft's lm_head (V')")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--head-lr-scale", type=float, default=0.3)
    ap.add_argument("--hard", type=float, default=0.5, help="weight of CE on the teacher's argmax")
    ap.add_argument("--feature", type=float, default=1.0, help="weight of smooth-L1 to the teacher's final hidden")
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--out", default="", help="where train saves the draft (default .cache/default_draft/draft)")
    ap.add_argument("--num-chat", type=int, default=680)
    ap.add_argument("--num-code-windows", type=int, default=800)
    ap.add_argument("--max-answer-tokens", type=int, default=160)
    ap.add_argument("--chat-chunk", type=int, default=136, help="chat answers per engine run; saved after each")
    ap.add_argument("--num-magpie", type=int, default=0, help="answers to this many scripts/magpie_prompts.py prompts")
    ap.add_argument("--magpie-answer-tokens", type=int, default=128)
    ap.add_argument("--magpie-greedy-every", type=int, default=5, help="every n-th Magpie answer greedy (0: none)")
    ap.add_argument("--magpie-chunk", type=int, default=256)
    ap.add_argument("--data-minutes", type=float, default=0.0,
                    help="start no Magpie chunk that would end (as long as the last) after this long (0: no limit)")
    ap.add_argument("--teacher-dtype", default="float32",
                    help="the engine's for the answers, and the logits stage's (float32 runs ~4.6x faster than "
                    "bfloat16 on a CPU without native bfloat16)")
    ap.add_argument("--teacher-batch", type=int, default=32)
    ap.add_argument("--feature-layers", default="",
                    help="logits stage: also keep the residual stream after these target layers (e.g. 2,15,27)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu",
                    help="where the target and the draft run in every stage: cpu, or cuda (a GPU, where the data and "
                    "the training take minutes)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    stages = dict(teacher=stage_teacher, data=stage_data, logits=stage_logits, train=stage_train)
    for name in args.stage.split(","):
        stages[name](args)


if __name__ == "__main__":
    main()
