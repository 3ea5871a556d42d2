"""Weight-only quantization through the real loader and engine: greedy output equals HF
transformers' generate with the same quantized layers swapped into HF's model (the oracle), for a
Llama and a Qwen2 (q/k/v biases, tied embeddings), in a batch with chunked prefill, with the packed
kernels alone and with the dense bfloat16 copy alone (the row counts at which a layer switches differ
between a batch and HF's one request, so each test keeps one path)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.model.model import Linear
from backend.model.linear_swap import RescoredHead, swap_linears
from backend.model.quantized_linear import Fp8Linear, Int4Linear, Int8Linear
from tests.model.test_engine_vs_hf import mixed_prompts, run_engine


@torch.inference_mode()
def hf_quantized_greedy(model_dir, mode: str, group_size: int, prompts, max_tokens,
                        dense_rows: int = -1) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    swap_linears(model, mode, group_size, dense_rows)
    outputs = []
    for prompt, n in zip(prompts, max_tokens):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("dense_rows", [-1, 1])  # packed kernels alone; the dense copy alone
@pytest.mark.parametrize("arch, mode, group_size", [
    ("tiny_llama", "int8", 32),
    ("tiny_llama", "int4", 32),
    ("tiny_qwen2", "int4", 64),
    ("tiny_qwen2", "int8", 32),
])
def test_quantized_engine_matches_hf_with_the_same_layers(arch, mode, group_size, dense_rows, request):
    model_dir = request.getfixturevalue(arch)
    engine = LLMEngine(EngineConfig(model=str(model_dir), quantization=mode, quantization_group_size=group_size,
                                    quantization_dense_rows=dense_rows, max_num_batched_tokens=48, num_threads=1))
    kind = Int8Linear if mode == "int8" else Int4Linear
    layers = [m for m in engine.model.model.modules() if isinstance(m, Linear)]
    assert layers and all(isinstance(m.quantized, kind) and m.weight is None for m in layers)
    head = engine.model.lm_head.quantized  # quantized like the layers, its best candidates rescored
    assert isinstance(head, RescoredHead) and isinstance(head.quantized, kind)
    assert all((m.quantized.dense_weight is not None) == (dense_rows > 0) for m in layers)
    prompts, max_tokens = mixed_prompts(12, seed=3)
    got = run_engine(engine, prompts, max_tokens)
    assert got == hf_quantized_greedy(model_dir, mode, group_size, prompts, max_tokens, dense_rows)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_fp8_engine_matches_hf_with_the_same_layers(arch, request):
    """FP8 weights and activations (torch's _scaled_mm here; on CUDA the Triton kernel for few
    rows): HF's greedy tokens with the same layers; the lm_head stays float."""
    model_dir = request.getfixturevalue(arch)
    engine = LLMEngine(EngineConfig(model=str(model_dir), quantization="fp8", max_num_batched_tokens=48,
                                    num_threads=1))
    layers = [m for m in engine.model.model.modules() if isinstance(m, Linear)]
    assert layers and all(isinstance(m.quantized, Fp8Linear) and m.weight is None for m in layers)
    assert engine.model.lm_head.quantized is None and engine.model.lm_head.weight.dtype == torch.float32
    prompts, max_tokens = mixed_prompts(12, seed=3)
    got = run_engine(engine, prompts, max_tokens)
    assert got == hf_quantized_greedy(model_dir, "fp8", 32, prompts, max_tokens)


@pytest.mark.parametrize("mode", ["int4", "fp8"])
def test_quantization_changes_the_output_of_a_random_model(tiny_llama, mode):
    """The quantized engine is not the float one in disguise: on random weights (no Q4_1 grid)
    int4's error, and FP8's, changes some greedy tokens."""
    prompts, max_tokens = mixed_prompts(12, seed=3)
    float_out = run_engine(LLMEngine(EngineConfig(model=str(tiny_llama), num_threads=1)), prompts, max_tokens)
    quantized_out = run_engine(LLMEngine(EngineConfig(model=str(tiny_llama), quantization=mode, num_threads=1,
                                                      quantization_dense_rows=-1)),
                               prompts, max_tokens)
    assert quantized_out != float_out
