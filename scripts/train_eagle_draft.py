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
draft (draft_model.load_draft).

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
import time
from pathlib import Path

import torch

from scripts.default_target import bf16_autocast, load_target
from scripts.draft_data import CACHE
from scripts.draft_model import load_draft
from scripts.eagle_head import add_fuse, load_head, new_head, save_head
from scripts.eagle_heldout import OUT, evaluate, heldout_sets, standalone
from scripts.eagle_timing import speedup, timings
from scripts.train_default_draft import distil_loss, select_vocab, train_batches


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
