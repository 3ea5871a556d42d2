"""Load a Llama-family model from a local HF checkpoint directory.

Config through transformers (so every RoPE scaling variant it knows is computed the same way),
weights through safetensors, straight into backend.model.model's modules (the names match HF's). The
model is built on the meta device first; under pipeline parallelism it is cut to one stage's
layers there, under tensor parallelism sharded there, and each weight's share is read out of the
checkpoint on its own, so a rank never holds the whole model.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backend.errors import ValidationError
from backend.model import eagle
from backend.model.model import (
    PACKED_PROJECTIONS,
    Linear,
    LlamaForCausalLM,
    ModelArgs,
    RotaryEmbedding,
)
from backend.model.pipeline_parallel import (
    PipelineStage,
    split_model,
    stage_parameter_name,
)
from backend.model.linear_swap import quantize_linears
from backend.model.tensor_parallel import (
    TensorParallelRank,
    checkpoint_slice,
    rank_share,
    shard_model,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# a draft with a reduced vocabulary (FR-Spec, 2025): its lm_head's rows are these
# target token ids (one int64 tensor "token_ids", sorted, unique); its probability is 0 elsewhere
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
EMBEDDINGS = "model.embed_tokens.weight"


def load_hf_config(model_dir: str | Path) -> PretrainedConfig:
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    archs = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValidationError(
            "model",
            f"architecture {archs or config.model_type!r} in {model_dir} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    return config


def model_args(config: PretrainedConfig) -> ModelArgs:
    qwen2 = config.model_type == "qwen2"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelArgs(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias=qwen2 or bool(getattr(config, "attention_bias", False)),
        o_bias=(not qwen2) and bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings,
    )


def rope_inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("default", None):
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValidationError("model", f"RoPE type {rope_type!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq, float(scaling)


WHOLE = (slice(None),)
Selector = Callable[[str], "tuple[slice, ...] | None"]  # checkpoint name -> the part to read (None: none)


def _whole(name: str) -> tuple[slice, ...]:
    return WHOLE


def load_model(
    model_dir: str | Path, dtype: str, device: torch.device, max_model_len: int,
    tensor_parallel: TensorParallelRank | None = None, stage: PipelineStage | None = None,
    head_rows: int | None = None, embeddings: torch.Tensor | None = None,
    quantization: str = "none", quantization_group_size: int = 32,
) -> tuple[LlamaForCausalLM, PretrainedConfig]:
    """The model; with `stage` only that pipeline stage's part of it; with `tensor_parallel` one
    rank's shard of that. A draft may have an lm_head of `head_rows` rows (a reduced
    vocabulary) and take its `embeddings` [vocab, hidden] from the target when its checkpoint
    has none (shared when the dtypes match). With `quantization` its linear layers are made
    weight-only quantized from the loaded weights (backend/model/quantized_linear.py)."""
    config = load_hf_config(model_dir)
    args = model_args(config)
    inv_freq, scaling = rope_inverse_frequencies(config, args.head_dim)
    with torch.device("meta"):
        model = LlamaForCausalLM(args, RotaryEmbedding(inv_freq.to("meta"), scaling, 1))
        if head_rows is not None:
            if args.tie_word_embeddings:
                raise ValidationError("draft_model", "a reduced vocabulary needs an lm_head of its own "
                                                     "(tie_word_embeddings false)")
            model.lm_head = Linear(args.hidden_size, head_rows, False)
    if stage is not None:
        split_model(model, stage)
    select: Selector = _whole
    if tensor_parallel is not None:
        share = rank_share(args, tensor_parallel.rank, tensor_parallel.world_size)
        select = functools.partial(checkpoint_slice, share=share, rank=tensor_parallel.rank)
        shard_model(model, tensor_parallel)  # shapes only: nothing is allocated yet
    model = model.to_empty(device=device).to(TORCH_DTYPES[dtype])
    rotary = RotaryEmbedding(inv_freq, scaling, max_model_len).to(device)
    for layer in model.model.layers:
        layer.self_attn.rotary = rotary
    given = set()
    if embeddings is not None and not _has_weight(Path(model_dir), EMBEDDINGS):
        if tuple(embeddings.shape) != tuple(model.model.embed_tokens.weight.shape):
            raise ValidationError("draft_model", f"has no embeddings, and the target's {tuple(embeddings.shape)} "
                                                 f"do not fit its {tuple(model.model.embed_tokens.weight.shape)}")
        weight = embeddings.to(device=device, dtype=TORCH_DTYPES[dtype])  # the same tensor when it fits
        model.model.embed_tokens.weight = torch.nn.Parameter(weight, requires_grad=False)
        given.add(EMBEDDINGS)
    _load_weights(model, Path(model_dir), device, select, stage, given)
    if model.shares_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    quantize_linears(model, quantization, quantization_group_size)
    return model.eval(), config


def _parameter_for(model: LlamaForCausalLM, name: str) -> tuple[str, slice | None]:
    """Where checkpoint tensor `name` goes: (parameter name, its row shard or None for all of it).
    q/k/v and gate/up land in their packed projection's rows (PACKED_PROJECTIONS)."""
    module_path, _, kind = name.rpartition(".")  # kind: weight or bias
    parent, _, proj = module_path.rpartition(".")
    if proj not in PACKED_PROJECTIONS:
        return name, None
    packed, shard = PACKED_PROJECTIONS[proj]
    module = model.get_submodule(f"{parent}.{packed}")
    return f"{parent}.{packed}.{kind}", module.shard_rows(shard)


def _weight_file(model_dir: Path, name: str) -> Path | None:
    """The checkpoint file that holds tensor `name`, or None."""
    for file in _weight_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if name in f.keys():
                return file
    return None


def _whole_tensor(model_dir: Path, name: str) -> torch.Tensor:
    file = _weight_file(model_dir, name)
    if file is None:
        raise ValidationError("model", f"no {name!r} in {model_dir}")
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return f.get_tensor(name)


def _has_weight(model_dir: Path, name: str) -> bool:
    return _weight_file(model_dir, name) is not None


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(f for f in model_dir.glob("*.safetensors") if f.name != DRAFT_VOCAB_FILE)


def _load_weights(model: LlamaForCausalLM, model_dir: Path, device: torch.device, select: Selector,
                  stage: PipelineStage | None, given: set[str] = frozenset()) -> None:
    """`given`: parameters set already (a draft's embeddings, the target's)."""
    files = _weight_files(model_dir)
    if not files:
        raise ValidationError("model", f"no *.safetensors weights in {model_dir}")
    params = dict(model.named_parameters())
    rows_left = {name: 0 if name in given else p.shape[0] for name, p in params.items()}  # rows not loaded yet
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.args.tie_word_embeddings):
                    continue
                local_name = name if stage is None else stage_parameter_name(name, stage, model.args.tie_word_embeddings)
                if local_name is None:  # another pipeline stage's
                    continue
                try:
                    param_name, rows = _parameter_for(model, local_name)
                except AttributeError:  # no such module
                    param_name, rows = name, None
                index = select(name)
                if index is None:  # none of it on this rank (a row-parallel bias off rank 0)
                    continue
                if param_name not in params:
                    raise ValidationError("model", f"unexpected weight {name!r} in {file.name}")
                target = params[param_name] if rows is None else params[param_name][rows]
                tensor = f.get_slice(name)[index]
                if tensor.shape != target.shape:
                    raise ValidationError(
                        "model", f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(tensor.to(device=device, dtype=target.dtype))
                rows_left[param_name] -= target.shape[0]
    if model.shares_embeddings:
        rows_left.pop("lm_head.weight", None)
    missing = sorted(name for name, rows in rows_left.items() if rows)
    if missing:
        raise ValidationError("model", f"weights missing from {model_dir}: {missing[:5]}")


def load_draft_model(
    draft_dir: str | Path, target: LlamaForCausalLM, tokenizer, dtype: str, device: torch.device, max_model_len: int
) -> LlamaForCausalLM:
    """Load a draft model and check that it can speak for the target: same vocabulary and
    tokenizer, a context at least max_model_len long. With DRAFT_VOCAB_FILE its lm_head covers
    those target tokens only (`draft.vocab_token_ids`, else None); without embeddings of its own
    it reads the target's."""
    draft_dir = Path(draft_dir)
    if not draft_dir.is_dir():
        raise ValidationError("draft_model", f"not a directory: {draft_dir}")
    token_ids = load_draft_vocab(draft_dir / DRAFT_VOCAB_FILE, target.args.vocab_size)
    embeddings = target.model.embed_tokens.weight if target.model.embed_tokens is not None else None
    draft, config = load_model(draft_dir, dtype, device, max_model_len,
                               head_rows=len(token_ids) if token_ids is not None else None, embeddings=embeddings)
    draft.vocab_token_ids = token_ids.to(device) if token_ids is not None else None
    if draft.args.vocab_size != target.args.vocab_size:
        raise ValidationError(
            "draft_model",
            f"vocabulary size {draft.args.vocab_size} differs from the target's {target.args.vocab_size}",
        )
    if (draft_dir / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        draft_tokenizer = AutoTokenizer.from_pretrained(str(draft_dir), local_files_only=True)
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValidationError("draft_model", "its tokenizer differs from the target's")
    if config.max_position_embeddings < max_model_len:
        raise ValidationError(
            "draft_model", f"context {config.max_position_embeddings} is shorter than max_model_len {max_model_len}"
        )
    return draft


def load_eagle_head(head_dir: str | Path, target: LlamaForCausalLM, dtype: str, device: torch.device,
                    max_model_len: int, target_dir: str | Path | None = None) -> eagle.EagleHead:
    """Load an EAGLE head (backend/model/eagle.py) for the target: its width must be the target's,
    its embeddings are the target's (the whole table, read from `target_dir` when the target's
    own is a tensor-parallel shard), its lm_head covers DRAFT_VOCAB_FILE's tokens (else all)."""
    head_dir = Path(head_dir)
    try:
        config = json.loads((head_dir / "config.json").read_text())
        layer_config = LlamaConfig.from_dict(config["decoder_layer"])
        final_norm = bool(config["final_norm"])
        feature_layers = tuple(config.get("feature_layers", ()))
        if config.get("architecture") != eagle.ARCHITECTURE:
            raise ValueError(f"architecture {config.get('architecture')!r} is not {eagle.ARCHITECTURE!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValidationError("draft_model", f"not an EAGLE head (config.json with architecture "
                              f"{eagle.ARCHITECTURE!r}, final_norm and decoder_layer) in {head_dir}: {e}") from None
    layer_config.num_hidden_layers = 1
    args = model_args(layer_config)
    args.tie_word_embeddings = False  # its lm_head is its own (the target's embeddings feed its input)
    if args.hidden_size != target.args.hidden_size:
        raise ValidationError("draft_model", f"an EAGLE head of width {args.hidden_size} cannot read the target's "
                              f"hidden states of width {target.args.hidden_size}")
    layers = target.args.num_layers
    if (not all(type(i) is int and 0 <= i < layers - 1 for i in feature_layers)
            or list(feature_layers) != sorted(set(feature_layers))):
        raise ValidationError("draft_model", f"feature_layers {list(feature_layers)} must be increasing target layers "
                              f"in [0, {layers - 1}) (the last layer's output is f itself)")
    token_ids = load_draft_vocab(head_dir / DRAFT_VOCAB_FILE, target.args.vocab_size)
    inv_freq, scaling = rope_inverse_frequencies(layer_config, args.head_dim)
    rows = len(token_ids) if token_ids is not None else target.args.vocab_size
    with torch.device("meta"):
        head = eagle.EagleHead(args, RotaryEmbedding(inv_freq.to("meta"), scaling, 1), rows, final_norm,
                               feature_layers)
    head = head.to_empty(device=device).to(TORCH_DTYPES[dtype])
    head.layer.self_attn.rotary = RotaryEmbedding(inv_freq, scaling, max_model_len).to(device)
    try:
        _load_weights(head, head_dir, device, _whole, None)
    except ValidationError as e:
        raise ValidationError("draft_model", e.message) from None
    head.embed_tokens = target.model.embed_tokens
    if type(head.embed_tokens) is not torch.nn.Embedding:  # a rank's share: the head reads every row
        head.embed_tokens = torch.nn.Embedding.from_pretrained(_whole_tensor(Path(target_dir), EMBEDDINGS).to(
            device=device, dtype=TORCH_DTYPES[dtype]))
    head.vocab_token_ids = token_ids.to(device) if token_ids is not None else None
    return head.eval()


def load_draft_vocab(path: Path, vocab_size: int) -> torch.Tensor | None:
    """[draft_vocab] int64 target token ids of a reduced draft vocabulary, or None without the file."""
    if not path.is_file():
        return None
    tensors = load_file(str(path))
    ids = tensors.get("token_ids")
    if ids is None or ids.dim() != 1 or ids.dtype != torch.int64 or not len(ids):
        raise ValidationError("draft_model", f"{path.name} must hold one int64 tensor 'token_ids' [draft_vocab]")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or bool((ids[1:] <= ids[:-1]).any()):
        raise ValidationError("draft_model", f"{path.name}: token_ids must be sorted, unique and in [0, {vocab_size})")
    return ids
