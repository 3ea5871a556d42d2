"""The tiny pair's Llama models: configured from a shape and the tokenizer, built, loaded, saved
(float16) and counted."""

from __future__ import annotations

import tempfile
from pathlib import Path
from shutil import copy2

import torch

from scripts.tiny_pair_tokenizer import VOCAB_SIZE, save_tokenizer


def llama_config(shape: dict, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=2048, rope_theta=10000.0,
                       tie_word_embeddings=True, rms_norm_eps=1e-5, hidden_act="silu",
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, **shape)


def new_model(shape: dict, tokenizer, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(shape, tokenizer))


def load_model(path: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)


def save_model(model, out_dir: Path, tokenizer, weights_only: bool, shard: str) -> None:
    """Save in float16. ``weights_only`` keeps config.json and the safetensors files alone."""
    from transformers import GenerationConfig

    model = model.to("cpu", torch.float16)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not weights_only:
        model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=shard)
        save_tokenizer(tokenizer, out_dir)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=shard)
        for f in Path(tmp).iterdir():
            if f.name == "config.json" or "safetensors" in f.name:
                copy2(f, out_dir / f.name)


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
