"""Varied chat prompts written by the default target itself, Magpie-style (Xu et al. 2024,
arXiv 2406.08464), as training prompts for its speculative drafts.

The target's chat template is rendered up to and including the user turn's header, with the default
system prompt the template adds when a conversation has none:

    <|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n
    <|im_start|>user\\n

and the target samples the user's message from there (this engine, `--dtype`, T = `--temperature`,
top-p `--top-p`, up to `--max-tokens` tokens, sample i seeded `--seed` + i), which ends at <|im_end|>.
A sample is kept when it ended there (not cut at `--max-tokens`), holds `--min-words` to `--max-words`
words and no chat markup, differs from every kept one (exact and near: the same first 8 lowercase
words), and is not a held-out prompt (scripts/chat_prompts.HELDOUT: the same first 8 words, one
containing the other, or a difflib ratio of `--heldout-ratio` or more), so the held-out evaluation
stays unseen.

Writes .cache/default_draft/magpie_prompts.json: the raw samples (a rerun with a larger
`--num-samples` generates only the missing ones, with the same seeds), the kept prompts in sample
order and the count of each rejection.

    nice -n 19 .venv/bin/python -m scripts.magpie_prompts --num-samples 3000 --chunk 384 --minutes 10 --threads 1

(on 1 core shared with other jobs: one chunk of 384 samples, ~8 min, 309 prompts kept)
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import time
from collections import Counter

from scripts.chat_prompts import HELDOUT, training_prompts
from scripts.default_target import TARGET
from scripts.draft_data import CACHE, generate_answers

OUT = CACHE / "magpie_prompts.json"
SENTINEL = "\x00"


def user_prefix(tok) -> list[int]:
    """The chat template's tokens before a user message's content (system prompt included)."""
    text = tok.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    return tok(text[:text.index(SENTINEL)], add_special_tokens=False).input_ids


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def near_key(text: str) -> str:
    return " ".join(words(text)[:8])


class HeldOutFilter:
    """Tells whether a prompt is, or is near, a held-out prompt."""

    def __init__(self, prompts: list[str], ratio: float):
        self.norms = [" ".join(words(p)) for p in prompts]
        self.keys = {near_key(p) for p in prompts}
        self.ratio = ratio

    def __call__(self, prompt: str) -> bool:
        norm = " ".join(words(prompt))
        if near_key(prompt) in self.keys:
            return True
        for held in self.norms:
            if held in norm or norm in held:
                return True
            matcher = difflib.SequenceMatcher(None, norm, held, autojunk=False)
            if matcher.real_quick_ratio() >= self.ratio and matcher.ratio() >= self.ratio:
                return True
        return False


def select(samples: list[dict], args) -> tuple[list[str], Counter]:
    """The kept prompts, in sample order, and why the others were dropped."""
    heldout = HeldOutFilter(HELDOUT, args.heldout_ratio)
    known = {" ".join(words(p)) for p in training_prompts()}  # the templated prompts already in data.pt
    kept, seen_exact, seen_near, why = [], set(), set(), Counter()
    for sample in samples:
        text = sample["text"].strip()
        n = len(words(text))
        if not sample["ended"]:
            why["no <|im_end|> within max tokens"] += 1
        elif "<|" in text or "|>" in text or text.lower().startswith(("assistant", "system", "user")):
            why["chat markup"] += 1
        elif not args.min_words <= n <= args.max_words:
            why["length"] += 1
        elif " ".join(words(text)) in seen_exact or " ".join(words(text)) in known:
            why["duplicate"] += 1
        elif near_key(text) in seen_near:
            why["near duplicate (first 8 words)"] += 1
        elif heldout(text):
            why["held-out (or near)"] += 1
        else:
            kept.append(text)
            seen_exact.add(" ".join(words(text)))
            seen_near.add(near_key(text))
    return kept, why


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-samples", type=int, default=6000)
    ap.add_argument("--chunk", type=int, default=512, help="samples per engine run; saved after each")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--min-words", type=int, default=3)
    ap.add_argument("--max-words", type=int, default=70)
    ap.add_argument("--heldout-ratio", type=float, default=0.75)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--minutes", type=float, default=0.0,
                    help="start no chunk that would end (as long as the last) after this long (0: no limit)")
    ap.add_argument("--dtype", default="float32", help="the engine's (float32 generates ~4.6x faster than bfloat16 "
                    "on a CPU without native bfloat16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the engine runs: cpu, or cuda (a GPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(TARGET, local_files_only=True)
    prefix = user_prefix(tok)
    state = json.loads(OUT.read_text()) if OUT.exists() else {}
    same = state.get("prefix") == prefix and all(state.get(k) == getattr(args, k)
                                                  for k in ("temperature", "top_p", "max_tokens", "seed", "dtype"))
    samples = state.get("samples", []) if same else []
    start, generated, last = time.monotonic(), 0, 0.0
    while len(samples) < args.num_samples:
        if args.minutes and time.monotonic() - start + last > args.minutes * 60:
            print(f"stopped: another chunk (~{last / 60:.1f} min) would end after {args.minutes} minutes")
            break
        tick = time.monotonic()
        n = min(args.chunk, args.num_samples - len(samples))
        outputs, tps = generate_answers([prefix] * n, args.max_tokens, args.temperature, args.dtype, args.threads,
                                        seed0=args.seed + len(samples), top_p=args.top_p,
                                        max_num_seqs=args.max_num_seqs, device=args.device)
        samples += [{"text": tok.decode(ids, skip_special_tokens=True), "tokens": len(ids),
                     "ended": bool(ids) and ids[-1] == tok.eos_token_id or len(ids) < args.max_tokens}
                    for ids in outputs]
        generated, last = generated + sum(map(len, outputs)), time.monotonic() - tick
        kept, _ = select(samples, args)
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(dict(prefix=prefix, temperature=args.temperature, top_p=args.top_p,
                                       max_tokens=args.max_tokens, seed=args.seed, dtype=args.dtype,
                                       samples=samples), indent=0))
        print(f"{len(samples)} samples ({generated} tokens this run, {tps:.0f} tok/s in the last chunk, "
              f"{(time.monotonic() - start) / 60:.1f} min): {len(kept)} kept", flush=True)
    kept, why = select(samples, args)
    OUT.write_text(json.dumps(dict(prefix=prefix, temperature=args.temperature, top_p=args.top_p,
                                   max_tokens=args.max_tokens, seed=args.seed, dtype=args.dtype, samples=samples,
                                   prompts=kept, rejected=dict(why)), indent=0))
    mean_words = sum(len(words(p)) for p in kept) / max(len(kept), 1)
    print(f"{len(samples)} samples -> {len(kept)} prompts (mean {mean_words:.1f} words); dropped: {dict(why)}")
    print(f"saved {OUT}")


if __name__ == "__main__":
    main()
