"""Benchmark prompts: code from the standard-library files held out of the default models'
training, the held-out chat prompts (scripts/chat_prompts.py) in the chat template, and synthetic
random-token prompts."""
from __future__ import annotations

import random

from perf import REPO_ROOT
from scripts.chat_prompts import HELDOUT, chat
from scripts.python_corpus import split_corpus

DEFAULT_TARGET = REPO_ROOT / "model_repository" / "llm_engine" / "1" / "target"
TINY_PAIR = REPO_ROOT / "tests" / "fixtures" / "tiny_pair"  # the test pair (the default before SmolLM2)


def heldout_texts(seed: int = 1234) -> list[str]:
    splits, _ = split_corpus(seed)
    return splits["heldout"]


def code_prompts(tokenizer, n: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """n prompts cut from held-out code at line starts, each min..max tokens long."""
    rng = random.Random(seed)
    texts = [t for t in heldout_texts() if len(t) > 4000]
    prompts = []
    while len(prompts) < n:
        text = rng.choice(texts)
        lines = text.splitlines(keepends=True)
        start = rng.randrange(len(lines) // 2)
        ids = tokenizer.encode("".join(lines[start:]))
        length = rng.randint(min_tokens, max_tokens)
        if len(ids) >= length:
            prompts.append(ids[:length])
    return prompts


def chat_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n of the held-out chat and code requests (never in a draft's training data), each as the
    model's chat template renders it for generation; cycled when n is more than there are."""
    order = list(HELDOUT)
    random.Random(seed).shuffle(order)
    rendered = [tokenizer.apply_chat_template(chat(p), tokenize=False, add_generation_prompt=True) for p in order]
    return [tokenizer(rendered[i % len(rendered)], add_special_tokens=False).input_ids for i in range(n)]


def random_prompts(vocab_size: int, n: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(min_tokens, max_tokens))] for _ in range(n)]
