"""Train the tiny draft/target Llama pair in tests/fixtures/tiny_pair (the server tests serve it
where the model does not matter; it was the default pair before SmolLM2-135M-Instruct).

Everything comes from text every machine has. ``--corpus stdlib`` (the first pair): the Python
standard library's own source files, dealt by file. ``--corpus projects``: the standard library
and every installed distribution's Python files, cleaned, deduplicated and dealt by whole project,
so that evaluation sees projects training never saw (scripts/python_corpus.py).
Stages (``--stage`` takes a comma list or ``all``):

  tokenizer  byte-level BPE (vocab 8192, <s> </s> <pad>) wrapped as a transformers fast tokenizer
  data       the corpus tokenized to uint16 arrays: train, valid (~1% of files, picks the best
             checkpoint) and heldout (stdlib: ~3% of files; projects: the same stdlib files,
             beside the held-out projects that scripts/eval_default_models.py reads itself)
  target     a ~12M-parameter Llama, next-token cross-entropy, AdamW + cosine
  draft      a ~1.5M-parameter Llama distilled from the target: KL(target || draft) + a little CE
  package    reload trained weights from --from and save them with the tokenizer (float16)

Then `python -m scripts.eval_default_models` reports held-out perplexity, draft/target agreement,
acceptance and predicted speedup.

Tokenizer and data land in .cache/default_models (projects: .cache/default_models/projects) and
are reused when present, so the training stages can run on a machine whose sources differ. Start to finish on one box:

    python -m scripts.train_default_models --stage all --target-minutes 20 --draft-minutes 5
    python -m scripts.eval_default_models

or with the training on a GPU machine that has a copy of .cache/default_models (shards small
enough to copy back, no tokenizer files), then packaged where the tokenizer was built:

    python -m scripts.train_default_models --stage tokenizer,data
    python -m scripts.train_default_models --stage target,draft --device cuda --out CKPT \
        --weights-only --shard 15MB --target-minutes 2.5 --draft-minutes 1
    python -m scripts.train_default_models --stage package --from CKPT
    python -m scripts.eval_default_models
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from scripts.python_corpus import split_corpus
from scripts.tiny_pair_models import load_model, new_model, num_params, save_model
from scripts.tiny_pair_tokenizer import train_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO_ROOT / ".cache" / "default_models"
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "tiny_pair"
STAGES = ("tokenizer", "data", "target", "draft", "package")
ALL_STAGES = ("tokenizer", "data", "target", "draft")  # package only runs when asked

TARGET_SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                    num_key_value_heads=2, intermediate_size=1024)
DRAFT_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=384)


# ----------------------------------------------------------------------------- tokenizer and data

def cache_dir(corpus: str) -> Path:
    return CACHE_DIR if corpus == "stdlib" else CACHE_DIR / corpus


def load_tokenizer(path: Path = CACHE_DIR / "tokenizer"):
    from transformers import AutoTokenizer

    if not (path / "tokenizer.json").exists():
        sys.exit(f"no tokenizer at {path}: run --stage tokenizer first")
    return AutoTokenizer.from_pretrained(path)


def tokenize(tokenizer, texts: list[str]) -> np.ndarray:
    """Concatenate ``<s> file </s>`` for every file into one uint16 array."""
    ids = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return np.concatenate([np.array([bos, *enc.ids, eos], dtype=np.uint16) for enc in ids])


def load_split(name: str, cache: Path = CACHE_DIR) -> np.ndarray:
    path = cache / f"{name}.npy"
    if not path.exists():
        sys.exit(f"no tokenized corpus at {path}: run --stage data first")
    return np.load(path)


# ----------------------------------------------------------------------------- training

def random_batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, device: str):
    """Endless random windows of seq_len + 1 tokens: inputs [B, T] and next-token labels [B, T]."""
    rng = np.random.default_rng(seed)
    offsets = np.arange(seq_len + 1)
    while True:
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
        window = torch.from_numpy(tokens[starts[:, None] + offsets].astype(np.int64))
        window = window.to(device, non_blocking=True)
        yield window[:, :-1], window[:, 1:]


def lr_at(progress: float, peak: float, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` fraction, then cosine down to 10% of peak."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * t)))


def fixed_windows(tokens: np.ndarray, num_windows: int, seq_len: int) -> torch.Tensor:
    """Evenly spaced, non-overlapping windows of seq_len + 1 tokens. Returns [N, seq_len + 1]."""
    n = min(num_windows, len(tokens) // (seq_len + 1))
    starts = np.linspace(0, len(tokens) - seq_len - 1, n).astype(np.int64)
    return torch.from_numpy(tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))


def train_loop(model, loss_fn, batches, valid: torch.Tensor, args, lr: float, seconds: float,
               steps: int | None, name: str) -> dict:
    """AdamW on ``loss_fn(model, inputs, labels)`` for ``steps`` steps, or until ``seconds`` pass.

    Every ``--valid-every`` steps the same loss is measured on the ``valid`` windows
    [N, seq_len + 1]; the model ends with the weights that scored best there.
    """
    device = args.device
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=device == "cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")

    @torch.no_grad()
    def validate() -> float:
        model.eval()
        with autocast:
            losses = [loss_fn(model, w[:, :-1], w[:, 1:])[0].item()
                      for w in valid.to(device).split(args.batch_size)]
        model.train()
        return sum(losses) / len(losses)

    best = dict(loss=math.inf, step=0, state=None)

    def keep_if_best(step: int) -> None:
        loss = validate()
        tqdm.write(f"{name} step {step} valid loss {loss:.4f}")
        if loss < best["loss"]:
            state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            best.update(loss=loss, step=step, state=state)

    model.train()
    start, step, tokens_seen = time.perf_counter(), 0, 0
    bar = tqdm(total=steps or int(seconds), desc=name, unit="step" if steps else "s",
               mininterval=1.0 if sys.stderr.isatty() else 30.0)
    while True:
        progress = step / steps if steps else (time.perf_counter() - start) / seconds
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, lr, args.warmup)
        inputs, labels = next(batches)
        with autocast:
            loss, parts = loss_fn(model, inputs, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += inputs.numel()
        bar.update(1 if steps else int(time.perf_counter() - start) - bar.n)
        if step % args.log_every == 0 or step == 1:
            shown = " ".join(f"{k} {v.item():.4f}" for k, v in parts.items())
            tqdm.write(f"{name} step {step} {shown} lr {opt.param_groups[0]['lr']:.2e} "
                       f"tokens {tokens_seen:,} elapsed {time.perf_counter() - start:.0f}s")
        if step % args.valid_every == 0:
            keep_if_best(step)
    bar.close()
    if step % args.valid_every:
        keep_if_best(step)
    model.load_state_dict(best["state"])
    summary = dict(steps=step, tokens=tokens_seen,
                   minutes=round((time.perf_counter() - start) / 60, 2), device=device,
                   best_valid_loss=round(best["loss"], 4), best_step=best["step"])
    print(f"{name} done: {json.dumps(summary)}")
    return summary


def target_loss(model, inputs, labels):
    logits = model(input_ids=inputs).logits  # [B, T, V]
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    return ce, {"ce": ce.detach()}


def distill_loss(teacher, ce_weight: float):
    """KL(target || draft) over next-token distributions, plus ``ce_weight`` x cross-entropy."""
    def loss_fn(model, inputs, labels):
        with torch.no_grad():
            teacher_logp = F.log_softmax(teacher(input_ids=inputs).logits.float(), -1).flatten(0, 1)
        logits = model(input_ids=inputs).logits.float().flatten(0, 1)  # [B*T, V]
        logp = F.log_softmax(logits, -1)
        kl = F.kl_div(logp, teacher_logp, log_target=True, reduction="batchmean")
        ce = F.nll_loss(logp, labels.flatten())
        return kl + ce_weight * ce, {"kl": kl.detach(), "ce": ce.detach()}
    return loss_fn


# ----------------------------------------------------------------------------- stages

def stage_tokenizer(args) -> None:
    splits, meta = split_corpus(args.seed, args.corpus)
    args.cache.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(splits["train"], args.cache / "tokenizer")
    print(f"tokenizer: {len(tok)} tokens from {meta['num_files']} files of Python {meta['python']}")


def stage_data(args) -> None:
    splits, meta = split_corpus(args.seed, args.corpus)
    tok = load_tokenizer(args.cache / "tokenizer")
    for name, texts in splits.items():
        tokens = tokenize(tok, texts)
        np.save(args.cache / f"{name}.npy", tokens)
        meta[f"{name}_tokens"] = int(len(tokens))
        meta[f"{name}_bytes"] = sum(len(t.encode()) for t in texts)
    (args.cache / "corpus.json").write_text(json.dumps(meta, indent=1))
    print(f"data: {meta['train_tokens']:,} train, {meta['valid_tokens']:,} valid, "
          f"{meta['heldout_tokens']:,} held-out tokens "
          f"({meta['train_bytes'] / meta['train_tokens']:.2f} bytes/token)")


def stage_target(args) -> None:
    tok = load_tokenizer(args.cache / "tokenizer")
    model = new_model(TARGET_SHAPE, tok, args.seed).to(args.device)
    print(f"target: {num_params(model):,} parameters on {args.device}")
    batches = random_batches(load_split("train", args.cache), args.batch_size, args.seq_len, args.seed, args.device)
    valid = fixed_windows(load_split("valid", args.cache), args.valid_windows, args.seq_len)
    train_loop(model, target_loss, batches, valid, args, args.target_lr,
               args.target_minutes * 60, args.target_steps, "target")
    save_model(model, args.out / "target", tok, args.weights_only, args.shard)


def stage_draft(args) -> None:
    tok = load_tokenizer(args.cache / "tokenizer")
    teacher_dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    teacher = load_model(args.out / "target", args.device, teacher_dtype).eval()
    model = new_model(DRAFT_SHAPE, tok, args.seed + 1).to(args.device)
    print(f"draft: {num_params(model):,} parameters on {args.device}")
    batches = random_batches(load_split("train", args.cache), args.batch_size, args.seq_len, args.seed + 1,
                             args.device)
    valid = fixed_windows(load_split("valid", args.cache), args.valid_windows, args.seq_len)
    train_loop(model, distill_loss(teacher, args.ce_weight), batches, valid, args, args.draft_lr,
               args.draft_minutes * 60, args.draft_steps, "draft")
    save_model(model, args.out / "draft", tok, args.weights_only, args.shard)


def stage_package(args) -> None:
    """Re-save checkpoints from ``--from`` (e.g. trained elsewhere) as complete model folders."""
    tok = load_tokenizer(args.cache / "tokenizer")
    for name in ("target", "draft"):
        model = load_model(args.from_dir / name, "cpu", torch.float16)
        save_model(model, args.out / name, tok, weights_only=False, shard="100MB")
        size = sum(f.stat().st_size for f in (args.out / name).glob("*.safetensors"))
        print(f"{name}: {num_params(model):,} parameters, {size / 1e6:.1f} MB -> {args.out / name}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", default="all",
                   help=f"comma list of {', '.join(STAGES)}, or all ({', '.join(ALL_STAGES)})")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--corpus", choices=("stdlib", "projects"), default="stdlib",
                   help="stdlib: the first pair's corpus; projects: stdlib + installed packages, by project")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cuda or cpu")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="holds target/ and draft/")
    p.add_argument("--from", dest="from_dir", type=Path, help="package: folder with target/ and draft/")
    p.add_argument("--weights-only", action="store_true", help="save only config.json + safetensors")
    p.add_argument("--shard", default="100MB", help="max safetensors shard size")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--target-minutes", type=float, default=20.0)
    p.add_argument("--target-steps", type=int, help="fixed step count (overrides minutes)")
    p.add_argument("--target-lr", type=float, default=2e-3)
    p.add_argument("--draft-minutes", type=float, default=5.0)
    p.add_argument("--draft-steps", type=int, help="fixed step count (overrides minutes)")
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--ce-weight", type=float, default=0.1, help="draft: weight of plain CE next to KL")
    p.add_argument("--warmup", type=float, default=0.03, help="fraction of the budget")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--valid-every", type=int, default=250, help="steps between validations")
    p.add_argument("--valid-windows", type=int, default=32, help="validation windows of --seq-len")
    args = p.parse_args(argv)
    args.stages = ALL_STAGES if args.stage == "all" else tuple(args.stage.split(","))
    unknown = set(args.stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stage(s) {sorted(unknown)}; choose from {STAGES}")
    if "package" in args.stages and args.from_dir is None:
        p.error("--stage package needs --from")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.cache = cache_dir(args.corpus)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    for stage in STAGES:
        if stage in args.stages:
            globals()[f"stage_{stage}"](args)


if __name__ == "__main__":
    main()
