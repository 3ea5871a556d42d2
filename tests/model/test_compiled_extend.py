"""Steps of several tokens per request compiled on a CPU (compile_prefill,
backend/model/compiled_extend.py): greedy output equals HF transformers' generate (float, int4 with
the same quantized layers swapped into HF's model, and beside an EAGLE head, whose verification
steps run compiled), the steps really run compiled, and two graphs serve every token count, mix
of requests and prefix-cache hit (no compile after start-up)."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.errors import ValidationError
from backend.model.model_runner import StepInput
from backend.model import quantized_linear
from backend.model.quantized_linear import Int4Linear, dense_linear, int4_product_op, prepack
from backend.sampling_params import SamplingParams
from specserve_kernels import int4_cpu
from tests.model.test_compiled_decode import assert_compiled_step_writes_as_eager
from tests.model.test_eagle import eagle_engine, head  # noqa: F401 (a fixture)
from tests.model.test_engine_vs_hf import hf_greedy, mixed_prompts, run_engine
from tests.model.test_quantization import hf_quantized_greedy


def extend_engine(model_dir, **knobs) -> LLMEngine:
    graphs = counters["stats"]["unique_graphs"]
    engine = LLMEngine(EngineConfig(model=str(model_dir), compile_prefill=True, num_threads=1, **knobs))
    # one prompt's prefill, any other step: both at start-up (none when an engine of the same model compiled
    # them), and the decode graphs' two where asked for
    assert counters["stats"]["unique_graphs"] - graphs in (0, 2 * (1 + knobs.get("compile_decode", False)))
    return engine


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_compiled_prefill_matches_hf(arch, request):
    """Prompts of 1 to 70 tokens in batches of 12 with a budget of 48 tokens a step (chunked
    prefill beside decodes, several prompts in one step), then a prompt whose first 32 tokens are
    cached (its prefill starts at position 32): the same tokens as HF, steps of several tokens
    compiled, and no graph compiled after start-up."""
    model_dir = request.getfixturevalue(arch)
    engine = extend_engine(model_dir, max_num_batched_tokens=48, block_size=8)
    graphs = counters["stats"]["unique_graphs"]
    prompts, max_tokens = mixed_prompts(12, seed=15)
    assert run_engine(engine, prompts, max_tokens) == [hf_greedy(model_dir, p, m) for p, m in zip(prompts, max_tokens)]
    prefix = list(range(10, 42))
    assert run_engine(engine, [prefix + [50, 51]], [8]) == [hf_greedy(model_dir, prefix + [50, 51], 8)]
    before = engine.runner.compiled_extend.steps
    assert run_engine(engine, [prefix + [60, 61, 62]], [8]) == [hf_greedy(model_dir, prefix + [60, 61, 62], 8)]
    assert engine.runner.compiled_extend.steps == before + 1  # the 3 uncached tokens
    assert engine.runner.compiled_extend.steps >= 5
    assert counters["stats"]["unique_graphs"] == graphs and engine.runner.compiled_extend.eager_steps == 0


def test_compiled_prefill_with_int4_layers_matches_hf_with_the_same_layers(tiny_llama):
    """The packed int4 kernels inside the compiled graph, decode steps compiled too: the same
    tokens as HF's model with the same quantized layers."""
    engine = extend_engine(tiny_llama, quantization="int4", quantization_dense_rows=-1, compile_decode=True,
                           max_num_batched_tokens=48)
    prompts, max_tokens = mixed_prompts(8, seed=16)
    assert run_engine(engine, prompts, max_tokens) == hf_quantized_greedy(tiny_llama, "int4", 32, prompts, max_tokens)
    assert engine.runner.compiled_extend.steps > 0 and engine.runner.compiled_decode.steps > 0
    assert engine.runner.compiled_extend.eager_steps == engine.runner.compiled_decode.eager_steps == 0


def test_int4_dense_copies_are_chosen_inside_the_graph(tiny_llama):
    """With int4 layers multiplying densely from 16 rows on, steps of any token count run compiled
    (a 4-token prompt alone, then 6 prompts in one step of 285 tokens), with the eager engine's
    tokens."""
    engine = extend_engine(tiny_llama, quantization="int4", quantization_dense_rows=16)
    compiled = engine.runner.compiled_extend
    assert compiled.max_tokens is None
    assert compiled.takes(300, 1) and not compiled.takes(1, 1) and not compiled.takes(8, 0)
    prompts, max_tokens = mixed_prompts(6, seed=17)
    got = run_engine(engine, [[5, 6, 7, 8]], [4]) + run_engine(engine, prompts, max_tokens)
    assert compiled.steps == 2 and compiled.eager_steps == 0
    eager = LLMEngine(EngineConfig(model=str(tiny_llama), quantization="int4", quantization_dense_rows=16))
    assert got == run_engine(eager, [[5, 6, 7, 8]], [4]) + run_engine(eager, prompts, max_tokens)


def test_the_int4_operator_multiplies_by_the_dense_copy_from_its_rows_on():
    """The operator the graphs call: below dense_min_rows the int4 kernel, from it on the layer's
    dense copy (here replaced by another weight, so that the two products differ)."""
    layer = Int4Linear(torch.randn(48, 64), None, 32)
    if layer.layout != "blocks":
        pytest.skip("needs the int4 CPU kernel")
    layer.use_dense_from(6)
    other = prepack(torch.randn(48, 64))
    quantized_linear._DENSE_COPIES[layer.dense_number] = other
    for rows in (1, 5, 6, 9):
        x = torch.randn(rows, 64)
        got = int4_product_op(x, layer.qweight, layer.step, layer.minimum, layer.dense_number, 6)
        expected = dense_linear(x, other) if rows >= 6 else int4_cpu.int4_linear(x, layer.qweight, layer.step,
                                                                                   layer.minimum)
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    x = torch.randn(9, 64)
    assert torch.equal(int4_product_op(x, layer.qweight, layer.step, layer.minimum, -1, 0),
                       int4_cpu.int4_linear(x, layer.qweight, layer.step, layer.minimum))


def test_verification_steps_run_compiled_beside_an_eagle_head(tiny_llama, head):  # noqa: F811
    """Speculation's verification steps (k + 1 tokens per request, logits for each) run in the
    graph of several rows of logits, and greedy output is still HF's."""
    engine = eagle_engine(tiny_llama, head, compile_prefill=True, num_threads=1, adaptive_speculation=False)
    prompts, max_tokens = mixed_prompts(6, seed=18)
    assert run_engine(engine, prompts, max_tokens) == [hf_greedy(tiny_llama, p, m) for p, m in zip(prompts, max_tokens)]
    compiled = engine.runner.compiled_extend
    assert compiled.steps > len(prompts) and compiled.eager_steps == 0


def test_a_compiled_mixed_step_writes_what_the_eager_step_writes(tiny_llama, head):  # noqa: F811
    """One step of a new 20-token prompt, a 3-token one and two requests decoding, beside an EAGLE
    head (its feature pool written by the graph), run compiled and then eagerly on the same
    inputs: the same logits, and the same K/V and features at the step's slots."""
    engine = eagle_engine(tiny_llama, head, compile_prefill=True, num_threads=1)
    for prompt in ([5, 6, 7], list(range(3, 40))):
        engine.add_request(prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    bs = engine.config.block_size
    step = StepInput([], [], [], [])
    for request in engine.requests.values():
        step.add([request.all_token_ids[-1]], request.num_computed_tokens, request.block_table, 1)
    free = iter(range(engine.num_blocks - 1, 0, -1))  # blocks at the pool's end: no request holds them yet
    for prompt, wanted in ((list(range(100, 120)), 1), ([9, 8, 7], 2)):
        step.add(prompt, 0, [next(free) for _ in range(-(-len(prompt) // bs))], wanted)
    slots = torch.tensor([t[p // bs] * bs + p % bs for tokens, start, t in
                          zip(step.token_ids, step.start_positions, step.block_tables)
                          for p in range(start, start + len(tokens))])
    compiled_logits = assert_compiled_step_writes_as_eager(engine, step, slots, "compiled_extend")
    assert compiled_logits.shape[0] == 2 + 1 + 2


def test_compiled_prefill_is_refused_across_ranks(tiny_llama):
    with pytest.raises(ValidationError, match="compile_prefill"):
        EngineConfig(model=str(tiny_llama), compile_prefill=True, pipeline_parallel_size=2)
