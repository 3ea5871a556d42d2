"""Evaluate the tiny draft/target pair (tests/fixtures/tiny_pair) on held-out standard-library files, or (``--heldout
projects``) on whole installed projects that the broad corpus holds out of training, one row each.

Reports held-out loss and perplexity of both models, how often the draft's greedy token matches the
target's, the expected acceptance a = sum_x min(p(x), q(x)) of speculative sampling (p target,
q draft; Leviathan et al. 2023, arXiv 2211.17192) at temperature 1 and 0.7, the measured cost ratio
c of a draft decode step to a target decode step, and the predicted speedup
S(k) = (1 - a^(k+1)) / ((1 - a)(k c + 1)) for k = 1..6 draft tokens per step.

    python -m scripts.eval_default_models            # models in tests/fixtures/tiny_pair
    python -m scripts.eval_default_models --heldout projects --windows 8

Acceptance at T = 0 is the greedy agreement (the draft's argmax is accepted exactly when it is the
target's).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from scripts.python_corpus import split_corpus, split_projects
from scripts.train_default_models import DEFAULT_OUT, cache_dir, fixed_windows, load_split, tokenize

TEMPERATURES = (1.0, 0.7)
DRAFT_LENGTHS = range(1, 7)


@dataclass(slots=True)
class PairStats:
    target_loss: float         # mean next-token cross-entropy, nats
    draft_loss: float
    greedy_agreement: float    # fraction of positions where both argmaxes agree
    acceptance: dict[float, float]  # temperature -> mean sum_x min(p(x), q(x))
    num_tokens: int


@torch.inference_mode()
def compare(target, draft, windows: torch.Tensor, device: str, batch_size: int = 8) -> PairStats:
    sums = dict(target_loss=0.0, draft_loss=0.0, agree=0.0, **{f"a{t}": 0.0 for t in TEMPERATURES})
    count = 0
    for batch in tqdm(windows.split(batch_size), desc="eval", leave=False):
        batch = batch.to(device)
        inputs, labels = batch[:, :-1], batch[:, 1:].flatten()
        p_logits = target(input_ids=inputs).logits.float().flatten(0, 1)  # [B*T, V]
        q_logits = draft(input_ids=inputs).logits.float().flatten(0, 1)   # [B*T, V]
        sums["target_loss"] += F.cross_entropy(p_logits, labels, reduction="sum").item()
        sums["draft_loss"] += F.cross_entropy(q_logits, labels, reduction="sum").item()
        sums["agree"] += (p_logits.argmax(-1) == q_logits.argmax(-1)).sum().item()
        for t in TEMPERATURES:
            p, q = F.softmax(p_logits / t, -1), F.softmax(q_logits / t, -1)
            sums[f"a{t}"] += torch.minimum(p, q).sum().item()
        count += labels.numel()
    return PairStats(target_loss=sums["target_loss"] / count, draft_loss=sums["draft_loss"] / count,
                     greedy_agreement=sums["agree"] / count,
                     acceptance={t: sums[f"a{t}"] / count for t in TEMPERATURES}, num_tokens=count)


@torch.inference_mode()
def decode_step_seconds(model, context_len: int = 128, repeats: int = 50) -> float:
    """Median wall time of one batch-1 decode step with a KV cache of ``context_len`` tokens."""
    from transformers import DynamicCache

    # transformers renamed the cache argument of forward() from past_key_values to cache
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    prompt = torch.randint(3, model.config.vocab_size, (1, context_len))
    cache = DynamicCache()
    model(input_ids=prompt, use_cache=True, **{cache_arg: cache})
    token = torch.tensor([[42]])
    times = []
    for i in range(repeats + 5):
        start = time.perf_counter()
        model(input_ids=token, use_cache=True, **{cache_arg: cache})
        elapsed = time.perf_counter() - start
        cache.crop(-1)  # drop the token just added: every step sees context_len cached tokens
        if i >= 5:
            times.append(elapsed)
    return statistics.median(times)


def speedup(a: float, k: int, c: float) -> float:
    """Expected tokens per target-forward time: (1 - a^(k+1)) / ((1 - a)(k c + 1))."""
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))


def weights_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6


def evaluate(model_dir: Path, heldout: np.ndarray, num_windows: int, seq_len: int,
             device: str = "cpu") -> str:
    """Run the whole evaluation and return it as markdown tables."""
    from transformers import AutoModelForCausalLM

    models = {name: AutoModelForCausalLM.from_pretrained(model_dir / name, dtype=torch.float32)
              .to(device).eval() for name in ("target", "draft")}
    stats = compare(models["target"], models["draft"], fixed_windows(heldout, num_windows, seq_len),
                    device)
    cpu = {name: m.to("cpu") for name, m in models.items()}
    step_s = {name: decode_step_seconds(m) for name, m in cpu.items()}
    c = step_s["draft"] / step_s["target"]

    lines = [f"Held-out: {stats.num_tokens:,} next-token positions "
             f"({num_windows} windows of {seq_len} tokens).", "",
             "| model | parameters | weights (fp16) | held-out loss | perplexity | decode step (CPU, batch 1) |",
             "|---|---|---|---|---|---|"]
    for name, loss in (("target", stats.target_loss), ("draft", stats.draft_loss)):
        params = sum(p.numel() for p in models[name].parameters())
        lines.append(f"| {name} | {params / 1e6:.2f}M | {weights_mb(model_dir / name):.1f} MB | "
                     f"{loss:.3f} | {np.exp(loss):.2f} | {step_s[name] * 1e3:.2f} ms |")
    lines += ["", "| greedy agreement | a (T=1) | a (T=0.7) | cost ratio c |", "|---|---|---|---|",
              f"| {stats.greedy_agreement:.1%} | {stats.acceptance[1.0]:.3f} | "
              f"{stats.acceptance[0.7]:.3f} | {c:.3f} |", "",
              "Predicted speedup S(k) = (1 - a^(k+1)) / ((1 - a)(k c + 1)):", "",
              "| temperature | a | " + " | ".join(f"k={k}" for k in DRAFT_LENGTHS) + " |",
              "|---|---|" + "---|" * len(DRAFT_LENGTHS)]
    for t in TEMPERATURES:
        a = stats.acceptance[t]
        lines.append(f"| {t} | {a:.3f} | "
                     + " | ".join(f"{speedup(a, k, c):.2f}" for k in DRAFT_LENGTHS) + " |")
    return "\n".join(lines)


def evaluate_projects(model_dir: Path, seed: int, windows_per_project: int, seq_len: int,
                      device: str = "cpu") -> str:
    """One row per held-out project (tokenized with the pair's own tokenizer), then all of them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir / "target")
    models = {name: AutoModelForCausalLM.from_pretrained(model_dir / name, dtype=torch.float32)
              .to(device).eval() for name in ("target", "draft")}
    built = cache_dir("projects") / "corpus.json"  # the held-out projects of the corpus trained on
    names = set(json.loads(built.read_text())["heldout_projects"]) if built.exists() else None
    _, projects, _ = split_projects(seed, set(split_corpus(seed)[1]["heldout_files"]), names)
    rows, weighted = [], []
    for name, files in projects.items():
        tokens = tokenize(tokenizer, list(files.values()))
        if len(tokens) <= seq_len + 1:
            continue
        stats = compare(models["target"], models["draft"], fixed_windows(tokens, windows_per_project, seq_len), device)
        weighted.append(stats)
        rows.append(f"| {name} | {stats.num_tokens:,} | {np.exp(stats.target_loss):.1f} | {np.exp(stats.draft_loss):.1f} | "
                    f"{stats.greedy_agreement:.1%} | {stats.acceptance[0.7]:.3f} | {stats.acceptance[1.0]:.3f} |")
    total = sum(s.num_tokens for s in weighted)

    def mean(get) -> float:
        return sum(get(s) * s.num_tokens for s in weighted) / total

    a = {0.0: mean(lambda s: s.greedy_agreement), 0.7: mean(lambda s: s.acceptance[0.7]),
         1.0: mean(lambda s: s.acceptance[1.0])}
    c = decode_step_seconds(models["draft"].to("cpu")) / decode_step_seconds(models["target"].to("cpu"))
    lines = [f"{len(rows)} held-out projects, up to {windows_per_project} windows of {seq_len} tokens each.", "",
             "| project | positions | target perplexity | draft perplexity | a (T=0, greedy agreement) | a (T=0.7) | a (T=1) |",
             "|---|---|---|---|---|---|---|", *rows,
             f"| all (by position) | {total:,} | {np.exp(mean(lambda s: s.target_loss)):.1f} | "
             f"{np.exp(mean(lambda s: s.draft_loss)):.1f} | {a[0.0]:.1%} | {a[0.7]:.3f} | {a[1.0]:.3f} |", "",
             f"Cost ratio c (draft / target decode step, CPU batch 1): {c:.3f}. Predicted S(k):", "",
             "| temperature | a | " + " | ".join(f"k={k}" for k in DRAFT_LENGTHS) + " |",
             "|---|---|" + "---|" * len(DRAFT_LENGTHS)]
    for t, value in a.items():
        lines.append(f"| {t} | {value:.3f} | " + " | ".join(f"{speedup(value, k, c):.2f}" for k in DRAFT_LENGTHS) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, default=DEFAULT_OUT, help="holds target/ and draft/")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--heldout", choices=("stdlib", "projects"), default="stdlib",
                   help="stdlib: held-out standard-library files; projects: held-out whole projects")
    p.add_argument("--seed", type=int, default=1234, help="the corpus split's seed (projects)")
    p.add_argument("--corpus", choices=("stdlib", "projects"), default="stdlib",
                   help="stdlib held-out files tokenized for the pair trained on this corpus")
    args = p.parse_args()
    torch.manual_seed(0)
    if args.heldout == "projects":
        print(evaluate_projects(args.models, args.seed, args.windows, args.seq_len, args.device))
    else:
        print(evaluate(args.models, load_split("heldout", cache_dir(args.corpus)), args.windows, args.seq_len,
                       args.device))


if __name__ == "__main__":
    main()
