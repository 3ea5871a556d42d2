"""A float32 model's linear layers on a CPU multiply by copies of their weights in oneDNN's layout
at the row counts where that measured faster at start-up (backend/model/linear_tuner.tune_cpu_linears)."""
from __future__ import annotations

import random
import sys

import pytest
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.model import linear_tuner
from backend.model.linear_tuner import rows_for_copy
from backend.model.model import Linear
from backend.sampling_params import SamplingParams
from tests.model.test_eagle import head  # noqa: F401 (the fixture)
from tests.model.test_engine_vs_hf import hf_greedy

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


def linears(model: torch.nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def test_a_layer_multiplies_by_its_onednn_copy_at_the_rows_chosen_only(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama)))
    layer = engine.model.model.layers[0].mlp.gate_up_proj
    x = torch.randn(6, layer.in_features)
    # a copy of another weight shows which rows multiply by it: 2 to 4 here
    layer.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight * 2, None)
    layer.onednn_rows = range(2, 5)
    plain = x @ layer.weight.t()
    for rows in range(1, 7):
        scale = 2 if rows in (2, 3, 4) else 1
        torch.testing.assert_close(layer(x[:rows]), scale * plain[:rows])


def test_greedy_output_with_a_copy_in_every_layer_equals_hf(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_seqs=8))
    for layer in linears(engine.model):
        layer.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight, None)
        layer.onednn_rows = range(1, sys.maxsize)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    ids = {engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)): p for p in prompts}
    got: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    assert [got[rid] for rid in ids] == [hf_greedy(tiny_llama, p, 12) for p in ids.values()]


@pytest.mark.parametrize("wins,chosen", [
    ({1, 2, 3, 4, 8, 16, 32, 64}, range(1, sys.maxsize)),  # faster everywhere: no upper limit
    ({2, 3, 4, 8, 16, 32, 64}, range(2, sys.maxsize)),     # slower at 1 row (a small layer)
    ({2, 3, 4, 8, 16}, range(2, 17)),                       # up to 16 rows, not at 32
    ({1, 2, 4, 8}, range(1, 3)),                            # the run of wins breaks at 3 rows
    ({3}, range(3, 4)),
    (set(), range(0)),                                      # never faster: no copy
])
def test_the_copy_is_used_over_the_first_unbroken_run_of_wins(wins, chosen):
    counts = (1, 2, 3, 4, 8, 16, 32, 64)
    assert rows_for_copy({rows: (2.0, 1.0 if rows in wins else 3.0) for rows in counts}) == chosen


@pytest.mark.parametrize("onednn_ms,chosen", [
    ({1: 1, 2: 1, 3: 1, 4: 1, 8: 1, 16: 1, 32: 1, 64: 1}, (1, None)),   # faster everywhere
    ({1: 1.96, 2: 1, 3: 1, 4: 1, 8: 1, 16: 1, 32: 1, 64: 1}, (2, None)),  # within the margin at 1 row
    ({1: 9, 2: 1, 3: 1, 4: 1, 8: 1, 16: 9}, (2, 8)),                     # timing stops after the run
    ({1: 9, 2: 9, 3: 9, 4: 9, 8: 9, 16: 9, 32: 9, 64: 9}, None),         # never: no copy kept
])
def test_tuning_gives_every_layer_of_a_shape_the_rows_measured(tiny_llama, monkeypatch, onednn_ms, chosen):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama)))
    shape = tuple(engine.model.model.layers[0].mlp.down_proj.weight.shape)
    timed_rows = []

    def time_call(fn, flush, repeats=10):  # torch's matmul 2 ms at every count, oneDNN's as given
        return next(calls)

    def times():
        for shape_timed in by_shape:
            for rows in linear_tuner.CPU_ROW_COUNTS:
                timed_rows.append((shape_timed, rows))
                yield 2e-3
                yield (onednn_ms[rows] if shape_timed == shape else 1) * 1e-3

    by_shape = list(dict.fromkeys(tuple(m.weight.shape) for m in linears(engine.model)))
    calls = times()
    monkeypatch.setattr(linear_tuner, "time_call", time_call)
    report = linear_tuner.tune_cpu_linears(engine.model)
    assert report[shape]["onednn_rows"] == chosen
    assert [rows for s, rows in timed_rows if s == shape][:len(onednn_ms)] == list(onednn_ms)
    layers = [m for m in linears(engine.model) if tuple(m.weight.shape) == shape]
    assert len(layers) == engine.model.args.num_layers
    for layer in layers:
        assert (layer.onednn_weight is None) == (chosen is None)
        if chosen is not None:
            assert (layer.onednn_rows.start, layer.onednn_rows.stop) == (chosen[0], (chosen[1] or sys.maxsize - 1) + 1)
        else:
            assert not layer.onednn_rows


def test_a_bfloat16_model_is_left_alone(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="bfloat16"))
    assert linear_tuner.tune_cpu_linears(engine.model) == {}
    assert all(layer.onednn_weight is None for layer in linears(engine.model))


def test_the_engine_tunes_a_float32_target_and_its_eagle_head(tiny_llama, head):  # noqa: F811
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), speculative_method="eagle", draft_model=str(head),
                                    num_speculative_tokens=2))
    assert set(engine.linear_choices) == {"target", "draft"}
    head_shapes = {tuple(m.weight.shape) for m in linears(engine.draft_model)}
    assert set(engine.linear_choices["draft"]) == head_shapes


def test_cpu_weight_copies_false_keeps_torchs_matmul_everywhere(tiny_llama, head):  # noqa: F811
    config = EngineConfig.from_strings({"model": str(tiny_llama), "speculative_method": "eagle",
                                        "draft_model": str(head), "cpu_weight_copies": "false"})
    engine = LLMEngine(config)
    assert engine.linear_choices == {}
    assert all(layer.onednn_weight is None and not layer.onednn_rows
               for model in (engine.model, engine.draft_model) for layer in linears(model))
