"""Compiled decode steps on a CPU (compile_decode, backend/model/compiled_decode.py): greedy output
equals HF transformers' generate (float, and int4 and fp8 with the same quantized layers swapped into
HF's model), the decode steps really run compiled, and two graphs serve every batch size and context
length (no compile after start-up)."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.errors import ValidationError
from backend.model.model_runner import StepInput
from backend.sampling_params import SamplingParams
from tests.conftest import write_tiny_model
from tests.model.test_eagle import eagle_engine, head  # noqa: F401 (a fixture)
from tests.model.test_engine_vs_hf import hf_greedy, mixed_prompts, run_engine
from tests.model.test_quantization import hf_quantized_greedy


def compiled_engine(model_dir, **knobs) -> LLMEngine:
    graphs = counters["stats"]["unique_graphs"]
    engine = LLMEngine(EngineConfig(model=str(model_dir), compile_decode=True, num_threads=1, **knobs))
    # one request, several: both at start-up (none when an engine of the same model and sizes compiled them)
    assert counters["stats"]["unique_graphs"] - graphs in (0, 2)
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
    assert counters["stats"]["unique_graphs"] == graphs and engine.runner.compiled_decode.eager_steps == 0


@pytest.mark.parametrize("mode", ["int4", "fp8"])
def test_compiled_decode_with_quantized_layers_matches_hf_with_the_same_layers(tiny_llama, mode):
    """The packed int4 kernels, or FP8's scaled products, inside the compiled graph: the same tokens
    as HF's model with the same quantized layers."""
    engine = compiled_engine(tiny_llama, quantization=mode, quantization_dense_rows=-1, max_num_batched_tokens=48)
    prompts, max_tokens = mixed_prompts(8, seed=6)
    got = run_engine(engine, prompts, max_tokens)
    assert got == hf_quantized_greedy(tiny_llama, mode, 32, prompts, max_tokens)
    assert engine.runner.compiled_decode.steps > 0 and engine.runner.compiled_decode.eager_steps == 0


def test_a_dense_copy_for_many_rows_does_not_split_the_graph(tiny_llama):
    """With int4 layers multiplying densely from 4 rows on, decode steps of 1 to 3 requests run in
    the two graphs compiled at start-up, steps of 4 to 12 eagerly through the copy, no graph is
    compiled after start-up, and the tokens are the eager engine's."""
    engine = compiled_engine(tiny_llama, quantization="int4", quantization_dense_rows=4)
    compiled = engine.runner.compiled_decode
    # timed at start-up: the fewest requests of those timed from which eager was faster (or none)
    assert set(compiled.timings) == {4, 8, 16, 32, 64}
    assert compiled.max_requests in (None, *compiled.timings)
    compiled.max_requests = 4  # the rest of the test does not depend on this machine's timings
    graphs = counters["stats"]["unique_graphs"]
    prompts, max_tokens = mixed_prompts(12, seed=8)
    got = run_engine(engine, prompts, max_tokens)
    assert compiled.steps > 0 and compiled.dense_steps > 0
    assert counters["stats"]["unique_graphs"] == graphs and compiled.eager_steps == 0
    eager = LLMEngine(EngineConfig(model=str(tiny_llama), quantization="int4", quantization_dense_rows=4))
    assert got == run_engine(eager, prompts, max_tokens)


def test_a_step_that_fits_no_graph_runs_eagerly_instead_of_compiling(tiny_llama):
    """A step no graph holds (here every step: the model gains a feature pool after the graphs
    were traced without one) is computed eagerly with the same result, and no graph is compiled."""
    engine = compiled_engine(tiny_llama)
    prompts, max_tokens = mixed_prompts(6, seed=9)
    expected = [hf_greedy(tiny_llama, p, m) for p, m in zip(prompts, max_tokens)]
    slots = engine.num_blocks * engine.config.block_size + 1
    engine.model.feature_pool = torch.zeros(slots, engine.model.args.hidden_size)
    graphs = counters["stats"]["unique_graphs"]
    assert run_engine(engine, prompts, max_tokens) == expected
    compiled = engine.runner.compiled_decode
    assert compiled.steps == 0 and compiled.eager_steps > 0 and counters["stats"]["unique_graphs"] == graphs


def test_a_compiled_step_writes_what_the_eager_step_writes(tiny_llama, head):  # noqa: F811
    """Beside an EAGLE head the target's forward also keeps every position's hidden state (the
    feature pool, a tensor the graph writes that is no argument of it). Three requests mid-decode,
    one step run compiled and then eagerly on the same inputs: the same logits, and the same K/V
    and features at the step's slots."""
    engine = eagle_engine(tiny_llama, head, compile_decode=True, num_threads=1)
    for prompt in ([5, 6, 7], list(range(3, 40)), list(range(50, 70))):
        engine.add_request(prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    bs = engine.config.block_size
    step = StepInput([], [], [], [])
    for request in engine.requests.values():
        step.add([request.all_token_ids[-1]], request.num_computed_tokens, request.block_table, 1)
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(step.block_tables, step.start_positions)])
    assert_compiled_step_writes_as_eager(engine, step, slots, "compiled_decode")


def assert_compiled_step_writes_as_eager(engine: LLMEngine, step: StepInput, slots: torch.Tensor,
                                         compiled_name: str) -> torch.Tensor:
    """Runs `step` through the runner's compiled path `compiled_name` (it must take the step), then
    eagerly on the same inputs: the same logits, and the same K/V and EAGLE features at `slots`.
    Returns the compiled step's logits."""
    runner, pool = engine.runner, engine.model.feature_pool
    compiled_path = getattr(runner, compiled_name)

    def written() -> list[torch.Tensor]:
        return [pool[slots].clone()] + [cache.flatten(0, 1)[slots].clone() for layer in runner.kv_caches for cache in layer]

    compiled_steps = compiled_path.steps
    compiled_logits = runner.run(step)
    assert compiled_path.steps == compiled_steps + 1
    compiled = written()
    pool[slots] = 0
    setattr(runner, compiled_name, None)
    try:
        eager_logits = runner.run(step)
    finally:
        setattr(runner, compiled_name, compiled_path)
    assert compiled[0].abs().sum() > 0
    torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-4, rtol=1e-4)
    for got, expected in zip(compiled, written()):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    return compiled_logits


def test_models_compiled_one_after_another_in_one_process_each_get_their_graphs(tiny_llama, tiny_qwen2, head):  # noqa: F811
    """Every model's forward is one code object, of which torch keeps recompile_limit graphs (8 by
    default): five models of different structures compiled in one process (10 graphs) all load
    and decode compiled."""
    with torch._dynamo.config.patch(recompile_limit=8):
        engines = [compiled_engine(tiny_llama), compiled_engine(tiny_qwen2),
                   *(compiled_engine(tiny_llama, quantization=m, quantization_dense_rows=-1) for m in ("int4", "fp8")),
                   eagle_engine(tiny_llama, head, compile_decode=True, num_threads=1)]  # (the target keeps features)
    for engine in engines:
        run_engine(engine, [[7, 3, 9]], [6])
        assert engine.runner.compiled_decode.steps > 0 and engine.runner.compiled_decode.eager_steps == 0


def test_compiled_decode_is_refused_across_ranks(tiny_llama):
    with pytest.raises(ValidationError, match="compile_decode"):
        EngineConfig(model=str(tiny_llama), compile_decode=True, tensor_parallel_size=2)


def test_a_machine_that_cannot_compile_fails_the_load_naming_the_parameter(tmp_path):
    """No C++ compiler (and no build cached on disk or in this process to fall back on: a model of
    a width no other test has): a ValidationError on compile_decode. (torch's own config patching:
    pytest's monkeypatch deletes a torch config entry on undo, and later compiles fail.)"""
    import torch._functorch.config
    import torch._inductor.config

    model_dir = write_tiny_model(tmp_path / "model", intermediate_size=136)
    torch._dynamo.reset()  # nor a graph an earlier test compiled (its sizes may have become dynamic)
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}), \
            torch._functorch.config.patch(enable_autograd_cache=False), \
            pytest.raises(ValidationError, match="compile_decode: torch.compile could not build"):
        LLMEngine(EngineConfig(model=str(model_dir), compile_decode=True, num_threads=1))


@pytest.mark.parametrize("copy_rows", [2, 3, 4])
def test_the_linear_copies_row_threshold_does_not_constrain_the_graphs(tiny_llama, monkeypatch, copy_rows):
    """Linear layers multiply by their oneDNN copies from a row count measured at load; inside a
    compiled graph they keep torch's matmul, and that count must not become a condition on the
    traced requests (3 made "several requests" the constant 2 and the load failed)."""
    import sys

    from backend.model import linear_tuner
    monkeypatch.setattr(linear_tuner, "rows_for_copy", lambda times: range(copy_rows, sys.maxsize))
    engine = compiled_engine(tiny_llama)
    assert engine.runner.model.lm_head.onednn_rows.start == copy_rows
    assert engine.runner.model.model.layers[0].mlp.down_proj.onednn_rows.start == copy_rows
    prompts, max_tokens = mixed_prompts(6, seed=11)
    assert run_engine(engine, prompts, max_tokens) == [hf_greedy(tiny_llama, p, m) for p, m in zip(prompts, max_tokens)]
    assert engine.runner.compiled_decode.steps > 0 and engine.runner.compiled_decode.eager_steps == 0
