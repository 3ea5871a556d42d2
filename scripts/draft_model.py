"""The standalone draft of scripts/train_default_draft.py: a Llama initialised from target layers with a
reduced lm_head, saved without its embedding and loaded back with the target's."""

from __future__ import annotations

from pathlib import Path

import torch

from scripts.default_target import TARGET


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
