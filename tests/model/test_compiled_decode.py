"""Compiled decode steps on a CPU (compile_decode, backend/model/compiled_decode.py): greedy output
equals HF transformers' generate (float, and int4 with the same quantized layers swapped into HF's
model), the decode steps really run compiled, and two graphs serve every batch size and context
length (no compile after start-up)."""
from __future__ import annotations

import pytest
from torch._dynamo.utils import counters

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.errors import ValidationError
from tests.model.test_engine_vs_hf import hf_greedy, mixed_prompts, run_engine
from tests.model.test_quantization import hf_quantized_greedy


def compiled_engine(model_dir, **knobs) -> LLMEngine:
    graphs = counters["stats"]["unique_graphs"]
    engine = LLMEngine(EngineConfig(model=str(model_dir), compile_decode=True, num_threads=1, **knobs))
    assert counters["stats"]["unique_graphs"] - graphs == 2  # one request, several: both at start-up
    return engine


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_compiled_decode_matches_hf(arch, request):
    """Prompts of 1 to 70 tokens (contexts of one page and of several), batches of 12 that shrink
    to 1 as requests finish, chunked prefill beside decodes: the same tokens as HF, with every
    pure decode step compiled and no graph compiled after start-up."""
    model_dir = request.getfixturevalue(arch)
    engine = compiled_engine(model_dir, max_num_batched_tokens=48)
    graphs = counters["stats"]["unique_graphs"]
    prompts, max_tokens = mixed_prompts(12, seed=5)
    assert run_engine(engine, prompts, max_tokens) == [hf_greedy(model_dir, p, m) for p, m in zip(prompts, max_tokens)]
    single = [7, 3]  # one request alone, its context inside one page
    assert run_engine(engine, [single], [20]) == [hf_greedy(model_dir, single, 20)]
    assert engine.runner.compiled_decode.steps >= 19 + max(max_tokens) // 2
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_decode_with_int4_matches_hf_with_the_same_layers(tiny_llama):
    """The packed int4 kernels inside the compiled graph: the same tokens as HF's model with the
    same quantized layers."""
    engine = compiled_engine(tiny_llama, quantization="int4", max_num_batched_tokens=48)
    prompts, max_tokens = mixed_prompts(8, seed=6)
    got = run_engine(engine, prompts, max_tokens)
    assert got == hf_quantized_greedy(tiny_llama, "int4", 32, prompts, max_tokens)
    assert engine.runner.compiled_decode.steps > 0


def test_compiled_decode_is_refused_across_ranks(tiny_llama):
    with pytest.raises(ValidationError, match="compile_decode"):
        EngineConfig(model=str(tiny_llama), compile_decode=True, tensor_parallel_size=2)
