"""Distil a draft model for the default target, SmolLM2-135M-Instruct, on this machine's CPU.

The draft is a small Llama with the target's tokenizer, width and embeddings: `--layers` decoder
layers (initialised from the target's first layers), the target's final norm, and the target's
tied embeddings as its embedding and lm_head (frozen, so that only the layers are trained and the
committed result is small). Training minimises KL(target || draft) over the vocabulary at every
position (the teacher's logits computed on the fly in bfloat16) on two kinds of text:

  chat   the target's own answers (T = 0.7, seeded) to scripts/chat_prompts.training_prompts(),
         whose topics the held-out evaluation prompts do not use
  code   Python standard-library files (scripts/python_corpus.py), tokenized with the target's
         tokenizer, in windows

Stages (``--stage`` a comma list): ``teacher`` measures the target's generation tok/s and prints
the estimated CPU time of the other stages; ``data`` generates the chat answers and cuts the code
windows into .cache/default_draft; ``train`` distils for ``--minutes`` and reports, before and
after, greedy agreement and the expected acceptance sum_x min(p, q) at T = 0.7 (Leviathan et al.
2023, arXiv 2211.17192) on the target's answers to the held-out prompts, never trained on.

    python scripts/train_default_draft.py --stage teacher
    nice -n 19 python scripts/train_default_draft.py --stage data,train --minutes 30
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.chat_prompts import HELDOUT, chat, training_prompts  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET = REPO_ROOT / "model_repository" / "llm_engine" / "1" / "target"
CACHE = REPO_ROOT / ".cache" / "default_draft"
SEQ_LEN = 256


def load_target(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=dtype, local_files_only=True).eval()
    return tok, model


def chat_ids(tok, prompt: str) -> list[int]:
    text = tok.apply_chat_template(chat(prompt), tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def generate_answers(prompts: list[list[int]], max_tokens: int, temperature: float, dtype: str,
                     threads: int) -> tuple[list[list[int]], float]:
    """The target's answers, batched through this engine; returns (answers, generated tok/s)."""
    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(TARGET), dtype=dtype, num_threads=threads, max_num_seqs=64))
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i))
           for i, p in enumerate(prompts)]
    answers: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            answers.setdefault(out.request_id, []).extend(out.token_ids)
    wall = time.perf_counter() - start
    return [answers[i] for i in ids], sum(map(len, answers.values())) / wall


def code_windows(tok, num_windows: int, seed: int) -> list[list[int]]:
    from scripts.python_corpus import stdlib_files

    rng = random.Random(seed)
    files = stdlib_files()
    rng.shuffle(files)
    windows: list[list[int]] = []
    for path in files:
        text = path.read_text(errors="ignore")
        ids = tok(text, add_special_tokens=False).input_ids
        windows += [ids[i:i + SEQ_LEN] for i in range(0, len(ids) - SEQ_LEN, SEQ_LEN * 4)]
        if len(windows) >= num_windows:
            break
    return windows[:num_windows]


def new_draft(target, num_layers: int):
    from transformers import LlamaForCausalLM

    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = num_layers
    draft = LlamaForCausalLM(config)
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    draft.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    draft.tie_weights()
    for name, p in draft.named_parameters():
        p.requires_grad = name.startswith("model.layers.")
    return draft


def kl_loss(teacher_logits: torch.Tensor, draft_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position, averaged over the masked positions. [B, T, V], [B, T, V], [B, T]"""
    p_log = F.log_softmax(teacher_logits.float(), -1)
    q_log = F.log_softmax(draft_logits.float(), -1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)  # [B, T]
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def batches(sequences: list[tuple[list[int], int]], batch_size: int, seed: int, pad: int):
    """Endless shuffled batches: (input_ids [B, T], loss mask [B, T]) from (ids, first loss position)."""
    rng = random.Random(seed)
    while True:
        rng.shuffle(sequences)
        for i in range(0, len(sequences) - batch_size + 1, batch_size):
            chunk = [(ids[:SEQ_LEN], start) for ids, start in sequences[i:i + batch_size]]
            length = max(len(ids) for ids, _ in chunk)
            input_ids = torch.full((batch_size, length), pad)
            mask = torch.zeros(batch_size, length)
            for row, (ids, start) in enumerate(chunk):
                input_ids[row, :len(ids)] = torch.tensor(ids)
                mask[row, max(start - 1, 0):len(ids) - 1] = 1  # positions that predict a loss token
            yield input_ids, mask


def stage_teacher(args) -> None:
    tok, _ = load_target(torch.float32)
    prompts = [chat_ids(tok, p) for p in training_prompts(args.seed)[:args.teacher_batch]]
    for dtype in ("float32", "bfloat16"):
        answers, tps = generate_answers(prompts, 64, 0.7, dtype, args.threads)
        print(f"teacher ({dtype}, batch {len(prompts)}, 64 tokens at T=0.7): {tps:.0f} generated tok/s")
    n = len(training_prompts(args.seed))
    print(f"data: {n} chat answers x ~{args.max_answer_tokens} tokens at that rate: "
          f"~{n * args.max_answer_tokens / tps / 60:.0f} min")


def stage_data(args) -> None:
    tok, _ = load_target(torch.float32)
    CACHE.mkdir(parents=True, exist_ok=True)
    prompts = [chat_ids(tok, p) for p in training_prompts(args.seed)[:args.num_chat]]
    answers, tps = generate_answers(prompts, args.max_answer_tokens, 0.7, args.teacher_dtype, args.threads)
    print(f"chat answers: {len(answers)}, {sum(map(len, answers))} tokens, {tps:.0f} tok/s")
    heldout = [chat_ids(tok, p) for p in HELDOUT]
    heldout_answers, _ = generate_answers(heldout, args.max_answer_tokens, 0.7, args.teacher_dtype, args.threads)
    code = code_windows(tok, args.num_code_windows, args.seed)
    torch.save(dict(chat=[(p + a, len(p)) for p, a in zip(prompts, answers)],
                    heldout=[(p + a, len(p)) for p, a in zip(heldout, heldout_answers)],
                    code=[(w, 1) for w in code]), CACHE / "data.pt")
    print(f"code windows: {len(code)} x {SEQ_LEN} tokens; saved {CACHE / 'data.pt'}")


@torch.inference_mode()
def evaluate(target, draft, sequences, batch_size: int = 4, pad: int = 2) -> tuple[float, float]:
    agree = accept = count = 0.0
    for i in range(0, len(sequences), batch_size):
        input_ids, mask = next(batches(sequences[i:i + batch_size], min(batch_size, len(sequences) - i), 0, pad))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            p_logits = target(input_ids).logits.float()
            q_logits = draft(input_ids).logits.float()
        m = mask.bool()
        agree += (p_logits.argmax(-1) == q_logits.argmax(-1))[m].sum().item()
        p, q = F.softmax(p_logits / 0.7, -1), F.softmax(q_logits / 0.7, -1)
        accept += torch.minimum(p, q).sum(-1)[m].sum().item()
        count += m.sum().item()
    return agree / count, accept / count


def stage_train(args) -> None:
    torch.manual_seed(args.seed)
    tok, target = load_target(torch.bfloat16)
    data = torch.load(CACHE / "data.pt")
    draft = new_draft(target, args.layers)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    print(f"draft: {args.layers} layers, {sum(p.numel() for p in trainable) / 1e6:.2f}M trained parameters")
    sequences = data["chat"] + data["code"]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    source = batches(sequences, args.batch_size, args.seed, tok.pad_token_id)
    before = evaluate(target, draft, data["heldout"])
    print(f"held-out before training: greedy agreement {before[0]:.3f}, acceptance at T=0.7 {before[1]:.3f}")
    start, step, tokens = time.monotonic(), 0, 0
    deadline = start + args.minutes * 60
    while time.monotonic() < deadline:
        input_ids, mask = next(source)
        progress = (time.monotonic() - start) / (deadline - start)
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, progress * 20) * 0.5 * (1 + math.cos(math.pi * progress))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            teacher_logits = target(input_ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            draft_logits = draft(input_ids).logits
        loss = kl_loss(teacher_logits, draft_logits, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step += 1
        tokens += int(mask.sum())
        if step % 20 == 0:
            elapsed = time.monotonic() - start
            print(f"step {step}: KL {loss.item():.3f}, {tokens / elapsed:.0f} trained tok/s, {elapsed / 60:.1f} min",
                  flush=True)
    after = evaluate(target, draft, data["heldout"])
    print(f"held-out after {step} steps ({tokens} tokens): greedy agreement {after[0]:.3f}, "
          f"acceptance at T=0.7 {after[1]:.3f}")
    out = CACHE / "draft"
    draft.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    print(f"saved {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="teacher")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--num-chat", type=int, default=680)
    ap.add_argument("--num-code-windows", type=int, default=400)
    ap.add_argument("--max-answer-tokens", type=int, default=160)
    ap.add_argument("--teacher-dtype", default="bfloat16")
    ap.add_argument("--teacher-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    stages = dict(teacher=stage_teacher, data=stage_data, train=stage_train)
    for name in args.stage.split(","):
        stages[name](args)


if __name__ == "__main__":
    main()
