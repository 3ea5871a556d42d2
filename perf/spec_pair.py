"""A target and draft pair with random weights whose greedy acceptance is set: for measuring
speculative decoding at a model shape when no trained pair of that shape is at hand (a GPU run).

The target is a random-weight Llama of the given shape whose layers write into the residual
stream at a scale eps (their o_proj and down_proj weights times eps, searched over 1e-4 to 1e4); the draft is the target's
first layer, its embedding, final norm and lm_head. At eps = 0 both predict from the last token's
embedding alone and always agree; as eps grows the target's other layers change its prediction
and the draft's agreement falls. eps is found by bisection so that the draft's greedy next token
equals the target's on the wanted share of the target's own greedy text, which is the acceptance
speculation sees at temperature 0. The draft costs what one layer and the lm_head cost
(at the 1B shape about a quarter of the target: the tied 128k-row lm_head dominates it).

    python perf/spec_pair.py OUT_DIR --shape 1b --acceptance 0.7     # on a GPU
    python perf/spec_pair.py OUT_DIR --shape tiny --acceptance 0.7   # a CPU smoke run
then OUT_DIR/target and OUT_DIR/draft go to perf/bench_speculative.py --target/--draft.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from perf.bench_gpu import SHAPE_1B, SHAPE_8B, SHAPE_TINY  # noqa: E402
from perf.prompts import TINY_PAIR  # noqa: E402

SHAPES = {"tiny": SHAPE_TINY, "1b": SHAPE_1B, "8b": SHAPE_8B}
CONTEXTS, PROMPT_LEN, GENERATED = 16, 16, 48  # agreement is measured on the target's greedy text
BISECTION_STEPS = 16


def build(shape: dict, device: torch.device, dtype: torch.dtype) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
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
    target, draft = build(shape, device, dtype)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--acceptance", type=float, default=0.7, help="greedy agreement wanted (0-1)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    found = write_pair(args.out, SHAPES[args.shape], args.acceptance, device, dtype)
    print(f"{args.shape} pair in {args.out}: eps {found['eps']:.4f}, greedy agreement {found['agreement']:.3f} "
          f"(wanted {args.acceptance}), draft 1 layer of {found['target_layers']}")


if __name__ == "__main__":
    main()
