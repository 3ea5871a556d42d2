"""Two probes of a saved EAGLE head on the held-out requests (scripts/chat_prompts.HELDOUT, never
trained on), with the float32 target's features; no training data needed.

  calibration  the target's T = 0.7 answers (seeded): acceptance sum_x min(p, q) with the draft
               sampled from softmax(z / (0.7 tau)) for each tau. Any q is verified exactly, so a
               tau that raises acceptance would be free.
  vocabulary   the target's greedy answers: the share of their tokens in the head's draft
               vocabulary (its ceiling), and step-1 agreement with the vocabulary filled up by the
               target's own embedding rows (untrained, scaled by each of --scales) beside the
               head's trained rows.

    python -m scripts.head_probe --threads 2      # the shipped head
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from scripts.chat_prompts import HELDOUT
from scripts.default_target import chat_ids, load_target
from scripts.eagle_head import load_head
from scripts.eagle_heldout import TEMPERATURE, answer_drafts, splits, target_answers, target_item

HEAD = Path(__file__).resolve().parent.parent / "model_repository" / "llm_engine" / "1" / "eagle"


def by_split(values: list[tuple[float, int]]) -> str:
    """'all a, chat b, code c' over per-request (sum, count) pairs, in HELDOUT's order."""
    return ", ".join(f"{name} {sum(s for s, _ in v) / sum(n for _, n in v):.3f}" for name, v in splits(values).items())


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, default=HEAD)
    ap.add_argument("--taus", type=float, nargs="+", default=[0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5])
    ap.add_argument("--scales", type=float, nargs="+", default=[0.8, 1.0])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok, target = load_target(torch.float32)
    embed = target.get_input_embeddings()
    head, token_ids = load_head(args.head)
    prompts = [chat_ids(tok, p) for p in HELDOUT]

    def drafts(answers: list[list[int]]) -> list[tuple]:  # per request: (normed f^, target argmax, p)
        items = [target_item(target, p + a, len(p), token_ids, []) for p, a in zip(prompts, answers)]
        return [(head.norm(f).float(), argmax, p) for f, argmax, p in (answer_drafts(head, embed, it) for it in items)]

    answers = target_answers(tok, target, prompts, max_new_tokens=args.max_new_tokens, do_sample=True,
                             temperature=TEMPERATURE, top_k=0, top_p=1.0)
    sampled = drafts(answers)
    print(f"calibration: {sum(len(s[1]) for s in sampled)} answer tokens at T = {TEMPERATURE}")
    lm_head = head.lm_head.weight.float()
    for tau in args.taus:
        accept = [(torch.minimum(p, F.softmax(h @ lm_head.T / (TEMPERATURE * tau), -1)).sum().item(), len(p))
                  for h, _, p in sampled]
        print(f"  tau {tau}: acceptance {by_split(accept)}")

    greedy = drafts(target_answers(tok, target, prompts))
    in_vocab = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    in_vocab[token_ids] = True
    print(f"vocabulary: {len(token_ids)} draft rows, {sum(len(g[1]) for g in greedy)} greedy answer tokens")
    covered = [(in_vocab[a].sum().item(), len(a)) for _, a, _ in greedy]
    print(f"  target argmax in the draft vocabulary: {by_split(covered)}")
    agree = [((token_ids[(h @ lm_head.T).argmax(-1)] == a).sum().item(), len(a)) for h, a, _ in greedy]
    print(f"  step-1 agreement, the head as trained: {by_split(agree)}")
    for scale in args.scales:
        rows = embed.weight.float() * scale
        rows[token_ids] = lm_head
        agree = [((h @ rows.T).argmax(-1) == a).sum().item() for h, a, _ in greedy]
        print(f"  step-1 agreement, every other row the target's embedding x {scale}: "
              f"{by_split([(s, len(g[1])) for s, g in zip(agree, greedy)])}")


if __name__ == "__main__":
    main()
