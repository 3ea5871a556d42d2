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
           a rerun keeps what data.pt already holds (see stage_data) and generates only the rest
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

from perf.harness import sync
from scripts.chat_prompts import HELDOUT, chat, training_prompts

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET = REPO_ROOT / "model_repository" / "llm_engine" / "1" / "target"
CACHE = REPO_ROOT / ".cache" / "default_draft"
SEQ_LEN = 256
TRAIN_SPLITS = ("chat", "magpie", "code")  # data.pt's training sequences; "heldout" is never trained on
MAGPIE_SEED = 1_000_000  # request seeds of the Magpie answers: MAGPIE_SEED + prompt index
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x KV heads x head dim x float32 bytes


def load_target(dtype: torch.dtype, device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=dtype, local_files_only=True).to(device).eval()
    return tok, model


def bf16_autocast(device: str, enabled: bool = True) -> torch.autocast:
    """bfloat16 autocast on `device`'s kind (cpu, cuda)."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=enabled)


def chat_ids(tok, prompt: str) -> list[int]:
    text = tok.apply_chat_template(chat(prompt), tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def generate_answers(prompts: list[list[int]], max_tokens: int, temperature: float | list[float], dtype: str,
                     threads: int, seed0: int = 0, top_p: float = 1.0,
                     max_num_seqs: int = 64, device: str = "cpu") -> tuple[list[list[int]], float]:
    """The target's answers, batched through this engine on `device` (request i seeded seed0 + i;
    temperature, one for all or one per prompt, 0 is greedy); returns (answers, generated tok/s)."""
    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.sampling_params import SamplingParams

    temperatures = temperature if isinstance(temperature, list) else [temperature] * len(prompts)
    longest = max(map(len, prompts)) + max_tokens
    kv_bytes = max(256 * 2**20, 2 * max_num_seqs * longest * KV_BYTES_PER_TOKEN)  # no preemption
    engine = LLMEngine(EngineConfig(model=str(TARGET), dtype=dtype, device=device, num_threads=threads,
                                    max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_bytes))
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=t, top_p=top_p, seed=seed0 + i))
           for i, (p, t) in enumerate(zip(prompts, temperatures))]
    answers: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            answers.setdefault(out.request_id, []).extend(out.token_ids)
    wall = time.perf_counter() - start
    return [answers[i] for i in ids], sum(map(len, answers.values())) / wall


def kept_prefix(old: list[tuple[list[int], int]], prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """The leading sequences of `old` whose prompts are `prompts`' (answers to keep: same prompt, same seed)."""
    kept = []
    for seq, prompt in zip(old, prompts):
        if seq[0][:seq[1]] != prompt:
            break
        kept.append(seq)
    return kept


def code_windows(tok, num_windows: int, seed: int) -> list[list[int]]:
    """SEQ_LEN-token windows (one every 4 * SEQ_LEN tokens) of shuffled Python standard-library files."""
    from scripts.python_corpus import stdlib_project

    rng = random.Random(seed)
    texts = list(stdlib_project().files.values())
    rng.shuffle(texts)
    windows: list[list[int]] = []
    for text in texts:
        ids = tok(text, add_special_tokens=False).input_ids
        windows += [ids[i:i + SEQ_LEN] for i in range(0, len(ids) - SEQ_LEN, SEQ_LEN * 4)]
        if len(windows) >= num_windows:
            break
    return windows[:num_windows]


def stage_teacher(args) -> None:
    """What a position of training data costs on this CPU, per dtype: the target's generation through
    this engine (`--teacher-batch` chat prompts in flight, 64 tokens at T = 0.7; the data stage) and its
    teacher-forced forward (`--batch-size` x SEQ_LEN tokens with the top-k; the logits stage). A position
    of the target's own answers needs both, so positions per hour = 3600 / (1 / generation + 1 / forward)."""
    tok, target = load_target(torch.float32, args.device)
    prompts = [chat_ids(tok, p) for p in training_prompts(args.seed)[:args.teacher_batch]]
    input_ids = torch.randint(tok.vocab_size, (args.batch_size, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    input_ids = input_ids.to(args.device)
    fastest = 0.0  # generated tok/s of the faster dtype
    for dtype in ("float32", "bfloat16"):
        _, generation = generate_answers(prompts, 64, 0.7, dtype, args.threads, max_num_seqs=len(prompts),
                                         device=args.device)
        with torch.inference_mode(), bf16_autocast(args.device, dtype == "bfloat16"):
            times = []
            for _ in range(2):  # the first warms up
                start = time.perf_counter()
                hidden, _ = target_hidden(target, input_ids, [])
                F.log_softmax(target.lm_head(hidden).float(), -1).topk(args.top_k, -1)
                sync(input_ids.device)
                times.append(time.perf_counter() - start)
        forward = input_ids.numel() / times[-1]
        print(f"teacher ({dtype}): generation {generation:.0f} tok/s ({len(prompts)} in flight), teacher-forced "
              f"forward {forward:.0f} tok/s ({args.batch_size} x {SEQ_LEN}): "
              f"{3600 / (1 / generation + 1 / forward):,.0f} positions of answers per hour", flush=True)
        fastest = max(fastest, generation)
    n = len(training_prompts(args.seed))
    print(f"data: {n} chat answers x ~{args.max_answer_tokens} tokens at the faster generation rate: "
          f"~{n * args.max_answer_tokens / fastest / 60:.0f} min")


def stage_data(args) -> None:
    """Held-out answers, code windows and chat answers into data.pt, saved after each step and each
    `--chat-chunk` chat answers; what is already there is kept (held-out answers to the same prompts,
    the same number of code windows, the leading chat answers to the same prompts: request i is seeded
    i whatever the chunking), so a rerun, or a larger --num-chat, generates only what is missing."""
    tok, _ = load_target(torch.float32)
    CACHE.mkdir(parents=True, exist_ok=True)
    old = torch.load(CACHE / "data.pt") if (CACHE / "data.pt").exists() else {}
    data = dict(magpie=old.get("magpie", []))
    heldout = [chat_ids(tok, p) for p in HELDOUT]
    if [s[0][:s[1]] for s in old.get("heldout", [])] == heldout:
        data["heldout"] = old["heldout"]
    else:
        answers, tps = generate_answers(heldout, args.max_answer_tokens, 0.7, args.teacher_dtype, args.threads,
                                        device=args.device)
        data["heldout"] = [(p + a, len(p)) for p, a in zip(heldout, answers)]
        print(f"held-out answers: {len(answers)}, {sum(map(len, answers))} tokens, {tps:.0f} tok/s", flush=True)
    if len(old.get("code", [])) == args.num_code_windows:
        data["code"] = old["code"]  # code_windows is deterministic: the same count, the same windows
    else:
        data["code"] = [(w, 1) for w in code_windows(tok, args.num_code_windows, args.seed)]
    prompts = [chat_ids(tok, p) for p in training_prompts(args.seed)[:args.num_chat]]
    data["chat"] = kept_prefix(old.get("chat", []), prompts)
    torch.save(data, CACHE / "data.pt")
    start = time.monotonic()
    while len(data["chat"]) < len(prompts):
        first = len(data["chat"])
        todo = prompts[first:first + args.chat_chunk]
        answers, tps = generate_answers(todo, args.max_answer_tokens, 0.7, args.teacher_dtype, args.threads,
                                        seed0=first, device=args.device)
        data["chat"] += [(p + a, len(p)) for p, a in zip(todo, answers)]
        torch.save(data, CACHE / "data.pt")
        print(f"chat answers: {len(data['chat'])} of {len(prompts)}, {sum(map(len, answers))} tokens in the last "
              f"chunk, {tps:.0f} tok/s, {(time.monotonic() - start) / 60:.1f} min", flush=True)
    print(f"chat: {len(data['chat'])} answers; code windows: {len(data['code'])} x {SEQ_LEN} tokens; "
          f"magpie: {len(data['magpie'])} answers; saved {CACHE / 'data.pt'}", flush=True)
    if args.num_magpie:
        magpie_answers(tok, data, args)


def magpie_answers(tok, data: dict, args) -> None:
    """The target's answers to the first `--num-magpie` prompts of scripts/magpie_prompts.py into
    data["magpie"]: every `--magpie-greedy-every`-th greedy, the others at T = 0.7 (prompt i seeded
    MAGPIE_SEED + i), up to `--magpie-answer-tokens` tokens, in chunks of `--magpie-chunk` (one engine
    run each) saved as they finish; no chunk starts that would end (as long as the last) after
    `--data-minutes`. Answers already there
    (the leading ones, to the same prompts) are kept."""
    import json

    texts = json.loads((CACHE / "magpie_prompts.json").read_text())["prompts"][:args.num_magpie]
    assert not {" ".join(t.lower().split()) for t in texts} & {" ".join(t.lower().split()) for t in HELDOUT}
    prompts = [chat_ids(tok, t) for t in texts]
    seqs = kept_prefix(data["magpie"], prompts)
    every = args.magpie_greedy_every
    start, tokens, wall, last = time.monotonic(), 0, 0.0, 0.0
    while len(seqs) < len(prompts):
        if args.data_minutes and time.monotonic() - start + last > args.data_minutes * 60:
            print(f"magpie answers: stopped, another chunk (~{last / 60:.1f} min) would end after "
                  f"{args.data_minutes} minutes")
            break
        first = len(seqs)
        chunk = prompts[first:first + args.magpie_chunk]
        temperatures = [0.0 if every and (first + i) % every == 0 else 0.7 for i in range(len(chunk))]
        tick = time.monotonic()
        answers, _ = generate_answers(chunk, args.magpie_answer_tokens, temperatures, args.teacher_dtype, args.threads,
                                      seed0=MAGPIE_SEED + first, max_num_seqs=128, device=args.device)
        last = time.monotonic() - tick
        wall += last
        seqs += [(p + a, len(p)) for p, a in zip(chunk, answers)]
        tokens += sum(map(len, answers))
        data["magpie"] = seqs
        torch.save(data, CACHE / "data.pt")
        print(f"magpie answers: {len(seqs)} of {len(prompts)}, {tokens} tokens this run, {tokens / wall:.0f} tok/s, "
              f"{(time.monotonic() - start) / 60:.1f} min", flush=True)
    print(f"magpie: {len(seqs)} answers, {sum(len(ids) - n for ids, n in seqs)} answer tokens", flush=True)


def draft_config(target_config, layers: list[int], vocab_size: int):
    """The target's Llama config with `layers` decoder layers and a `vocab_size`-row lm_head; the
    input vocabulary (vocab_size in the config) stays the target's, whose embedding the draft uses."""
    config = target_config.__class__.from_dict(target_config.to_dict())
    config.num_hidden_layers = len(layers)
    config.tie_word_embeddings = False
    config.draft_vocab_size = vocab_size  # rows of lm_head; draft_vocab.safetensors maps them to token ids
    config.draft_layers_from_target = list(layers)  # provenance of the initialisation
    config.dtype = "bfloat16"
    return config


def new_draft(target, layers: list[int], token_ids: torch.Tensor):
    """A draft initialised from the target: its decoder layers `layers` (in order), its final norm,
    its embedding (frozen; not saved) and an lm_head of its embedding rows `token_ids` (trained)."""
    from transformers import LlamaForCausalLM

    draft = LlamaForCausalLM(draft_config(target.config, layers, len(token_ids)))
    draft.lm_head = torch.nn.Linear(target.config.hidden_size, len(token_ids), bias=False)
    target_state = {k: v.float().cpu() for k, v in target.state_dict().items()}
    state = {k: v for k, v in target_state.items() if not k.startswith(("model.layers.", "lm_head."))}
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{layer}."
        state.update({f"model.layers.{i}.{k[len(prefix):]}": v for k, v in target_state.items()
                      if k.startswith(prefix)})
    state["lm_head.weight"] = state["model.embed_tokens.weight"][token_ids.cpu()].clone()
    draft.load_state_dict(state, strict=True)
    draft.model.embed_tokens.weight.requires_grad = False
    return draft.to(target.device)


def save_draft(draft, token_ids: torch.Tensor, out: Path) -> None:
    """config.json, model.safetensors (bfloat16, without model.embed_tokens), draft_vocab.safetensors
    (int64 token_ids [V'], ascending) and the target's tokenizer files."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    draft.config.save_pretrained(out)
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in draft.state_dict().items()
             if k != "model.embed_tokens.weight"}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    save_file({"token_ids": token_ids.to("cpu", torch.int64).contiguous()}, out / "draft_vocab.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json"):
        if (TARGET / name).exists():
            shutil.copy(TARGET / name, out / name)


def load_draft(path: Path, target):
    """The saved draft as a LlamaForCausalLM (float32) with the target's embedding, on the target's device;
    returns (draft, token_ids)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(path)
    token_ids = load_file(path / "draft_vocab.safetensors")["token_ids"]
    draft = LlamaForCausalLM(config)
    draft.lm_head = torch.nn.Linear(config.hidden_size, len(token_ids), bias=False)
    state = {k: v.float() for k, v in load_file(path / "model.safetensors").items()}
    state["model.embed_tokens.weight"] = target.get_input_embeddings().weight.detach().float().cpu()
    draft.load_state_dict(state, strict=True)
    return draft.to(target.device).eval(), token_ids.to(target.device)


def padded(sequences: list[tuple[list[int], int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T] right-padded, loss mask [B, T]: the positions that predict an answer token)."""
    length = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), length), pad)
    mask = torch.zeros(len(sequences), length, dtype=torch.bool)
    for row, (ids, start) in enumerate(sequences):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        mask[row, max(start - 1, 0):len(ids) - 1] = True
    return input_ids, mask


def target_hidden(target, input_ids: torch.Tensor, feature_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's final normed hidden states [B, T, H] and, for `feature_layers`, the residual stream
    after each of those layers (HF's decoder layer output) stacked [B, T, len, H] (None without)."""
    captured = []
    hook = lambda module, inputs, output: captured.append(output[0] if isinstance(output, tuple) else output)  # noqa: E731
    handles = [target.model.layers[i].register_forward_hook(hook) for i in feature_layers]
    try:
        hidden = target.model(input_ids).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    return hidden, torch.stack(captured, 2) if captured else None


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
