"""Random-weight Llama checkpoints for measuring at a model's shape without its weights: the
tiny, Llama-3.2-1B and Llama-3.1-8B shapes in bfloat16 (`write_model`), a small Llama of any
shape with a word-level tokenizer over its whole vocabulary (`write_random_llama`), and a target
and draft pair whose greedy agreement is set (`write_pair`).

The pair: the target is a random-weight Llama of the given shape whose layers write into the
residual stream at a scale eps (their o_proj and down_proj weights times eps, searched over 1e-4
to 1e4); the draft is the target's first layer, its embedding, final norm and lm_head. At eps = 0
both predict from the last token's embedding alone and always agree; as eps grows the target's
other layers change its prediction and the draft's agreement falls. eps is found by bisection so
that the draft's greedy next token equals the target's on the wanted share of the target's own
greedy text, which is the acceptance speculation sees at temperature 0. The draft costs what one
layer and the lm_head cost (at the 1B shape about a quarter of the target: the tied 128k-row
lm_head dominates it).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from perf.prompts import TINY_PAIR

SHAPE_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, head_dim=64,
                rope_theta=500000.0, max_position_embeddings=4096)
SHAPE_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, head_dim=128,
                rope_theta=500000.0, max_position_embeddings=4096)
SHAPE_TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True, head_dim=32,
                  max_position_embeddings=2048)

SHAPES = {"tiny": SHAPE_TINY, "1b": SHAPE_1B, "8b": SHAPE_8B}
NUM_SPECIAL_TOKENS = 3  # <s>, </s>, <pad> at ids 0..2 in write_random_llama's checkpoint; prompts avoid them
CONTEXTS, PROMPT_LEN, GENERATED = 16, 16, 48  # a pair's agreement is measured on the target's greedy text
BISECTION_STEPS = 16


def write_model(path: Path, shape: dict, device: torch.device) -> int:
    """A bfloat16 checkpoint of `shape` (seed 0) with the test pair's tokenizer; its weight bytes."""
    torch.manual_seed(0)
    config = LlamaConfig(**shape, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    # any tokenizer serves: the output text is not measured (ids past its vocabulary decode to "")
    AutoTokenizer.from_pretrained(str(TINY_PAIR / "target")).save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def write_random_llama(path: Path, args: argparse.Namespace) -> Path:
    """A random-weight Llama checkpoint plus a word-level tokenizer covering its whole vocabulary."""
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_position_embeddings, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2} | {f"w{i}": i for i in range(NUM_SPECIAL_TOKENS, args.vocab)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials).save_pretrained(path)
    return path


def build_pair(shape: dict, device: torch.device, dtype: torch.dtype) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """The target (its layers' output projections unscaled yet) and the draft sharing its first
    layer, embedding, final norm and lm_head."""
    torch.manual_seed(0)
    config = LlamaConfig(**shape, bos_token_id=0, eos_token_id=1, torch_dtype=str(dtype).removeprefix("torch."))
    with torch.device(device):
        target = LlamaForCausalLM(config).to(dtype).eval()
        draft = LlamaForCausalLM(LlamaConfig(**dict(shape, num_hidden_layers=1), bos_token_id=0, eos_token_id=1,
                                             torch_dtype=config.torch_dtype)).to(dtype).eval()
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("model.layers.") or k.startswith("model.layers.0.")})
    return target, draft


def scale_outputs(model: LlamaForCausalLM, originals: list[tuple[torch.Tensor, torch.Tensor]], eps: float) -> None:
    for layer, (o, down) in zip(model.model.layers, originals):
        layer.self_attn.o_proj.weight.copy_(o * eps)
        layer.mlp.down_proj.weight.copy_(down * eps)


@torch.inference_mode()
def agreement(target: LlamaForCausalLM, draft: LlamaForCausalLM, prompts: torch.Tensor) -> float:
    """Share of the target's greedy continuations of `prompts` that the draft predicts, token by
    token (what a verification at temperature 0 accepts). Measured on the target's own text, not on
    random contexts: a random-weight model's greedy text settles into patterns that a draft may
    follow better or worse than it predicts random text."""
    text = target.generate(prompts, max_new_tokens=GENERATED, min_new_tokens=GENERATED, do_sample=False,
                           pad_token_id=0)
    predicted = slice(prompts.shape[1] - 1, -1)  # positions whose next token is generated
    return (draft(text).logits[:, predicted].argmax(-1) == text[:, prompts.shape[1]:]).float().mean().item()


@torch.inference_mode()
def write_pair(out: Path, shape: dict, acceptance: float, device: torch.device, dtype: torch.dtype) -> dict:
    """Writes out/target and out/draft (tokenizer included); returns eps and the agreement found."""
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_PAIR / "target"))  # any: the text is not measured
    shape = dict(shape, vocab_size=max(shape["vocab_size"], len(tokenizer)))  # prompts are its ids
    target, draft = build_pair(shape, device, dtype)
    originals = [(layer.self_attn.o_proj.weight.clone(), layer.mlp.down_proj.weight.clone())
                 for layer in target.model.layers]
    generator = torch.Generator(device="cpu").manual_seed(1)
    prompts = torch.randint(2, shape["vocab_size"], (CONTEXTS, PROMPT_LEN), generator=generator).to(device)
    target.generation_config.eos_token_id = None
    lo, hi = -4.0, 4.0  # log10 eps: agreement falls as eps grows (random layers write little at eps 1)
    found = None
    for _ in range(BISECTION_STEPS):
        eps = 10 ** ((lo + hi) / 2)
        scale_outputs(target, originals, eps)
        scale_outputs(draft, originals[:1], eps)
        got = agreement(target, draft, prompts)
        found = (eps, got) if found is None or abs(got - acceptance) < abs(found[1] - acceptance) else found
        lo, hi = ((lo + hi) / 2, hi) if got > acceptance else (lo, (lo + hi) / 2)
    eps, got = found
    scale_outputs(target, originals, eps)
    scale_outputs(draft, originals[:1], eps)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(out / name, safe_serialization=True)
        tokenizer.save_pretrained(out / name)
    return dict(eps=eps, agreement=got, target_layers=len(target.model.layers))
