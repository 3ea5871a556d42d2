"""Shared fixtures: tiny random HF checkpoints written to disk, loaded through the real loaders."""
from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from serving.launch.launcher import free_port  # noqa: F401 (tests import it from here)

THREADS = torch.get_num_threads()  # torch's default: every core

# property tests draw the same examples on every run, so a run's verdict depends on the code alone;
# `pytest --hypothesis-profile=explore` draws new ones (and a failure found that way becomes an @example)
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("repeatable")


@pytest.fixture(autouse=True)
def _torch_threads():
    """An engine built with num_threads=1 sets torch's threads for the whole process; each test
    starts from torch's default again, so one test's choice does not slow every test after it."""
    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


TINY_VOCAB = 256 + 3  # bytes plus <s>, </s>, <pad>


def _byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with one token per byte (ids 3..258) and specials 0..2."""
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[ch] = 3 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def write_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(arch)
    model.save_pretrained(path, safe_serialization=True)
    _byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def bad_draft(tmp_path_factory) -> Path:
    """A draft that is bad on purpose: random weights, another shape."""
    return write_tiny_model(tmp_path_factory.mktemp("bad_draft"), "llama", seed=7, hidden_size=32,
                            intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=1, tie_word_embeddings=True)
