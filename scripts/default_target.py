"""The default target, SmolLM2-135M-Instruct, as the draft-training scripts run it: where it lives,
loaded with its tokenizer, a chat prompt's token ids, its hidden states, bfloat16 autocast."""

from __future__ import annotations

from pathlib import Path

import torch

from scripts.chat_prompts import chat

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET = REPO_ROOT / "model_repository" / "llm_engine" / "1" / "target"


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

