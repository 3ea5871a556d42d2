"""The draft-training data (scripts/train_default_draft.py's teacher and data stages): the target's
answers through this engine to held-out, chat and Magpie prompts and code windows, into
.cache/default_draft/data.pt, and those sequences as padded batches."""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from perf.harness import sync
from scripts.chat_prompts import HELDOUT, training_prompts
from scripts.default_target import REPO_ROOT, TARGET, bf16_autocast, chat_ids, load_target, target_hidden

CACHE = REPO_ROOT / ".cache" / "default_draft"
SEQ_LEN = 256
TRAIN_SPLITS = ("chat", "magpie", "code")  # data.pt's training sequences; "heldout" is never trained on
MAGPIE_SEED = 1_000_000  # request seeds of the Magpie answers: MAGPIE_SEED + prompt index
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x KV heads x head dim x float32 bytes


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


def padded(sequences: list[tuple[list[int], int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T] right-padded, loss mask [B, T]: the positions that predict an answer token)."""
    length = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), length), pad)
    mask = torch.zeros(len(sequences), length, dtype=torch.bool)
    for row, (ids, start) in enumerate(sequences):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        mask[row, max(start - 1, 0):len(ids) - 1] = True
    return input_ids, mask
