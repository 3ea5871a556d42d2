"""A float32 lm_head on a CPU multiplies by a copy of its weight in oneDNN's layout where that
measured faster at start-up (backend/model/linear_tuner.tune_cpu_head)."""
from __future__ import annotations

import random

import pytest
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.model import linear_tuner
from backend.sampling_params import SamplingParams
from tests.model.test_engine_vs_hf import hf_greedy

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


def test_the_head_multiplies_by_its_onednn_copy_from_the_rows_chosen(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama)))
    head = engine.model.lm_head
    head.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(head.weight, None)
    head.onednn_min_rows = 3
    x = torch.randn(4, head.in_features)
    torch.testing.assert_close(head(x), x @ head.weight.t())
    # the copy is what multiplies from 3 rows on: a copy of another weight changes those outputs only
    head.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(head.weight * 2, None)
    torch.testing.assert_close(head(x), 2 * (x @ head.weight.t()))
    torch.testing.assert_close(head(x[:2]), x[:2] @ head.weight.t())


def test_greedy_output_with_the_onednn_head_equals_hf(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_seqs=8))
    head = engine.model.lm_head
    head.onednn_weight, head.onednn_min_rows = torch.ops.mkldnn._reorder_linear_weight(head.weight, None), 1
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    ids = {engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)): p for p in prompts}
    got: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    assert [got[rid] for rid in ids] == [hf_greedy(tiny_llama, p, 12) for p in ids.values()]


@pytest.mark.parametrize("onednn_ms,chosen", [
    ({64: 1, 16: 1, 8: 1, 4: 1, 3: 1, 2: 1, 1: 1}, 1),      # faster everywhere
    ({64: 1, 16: 1, 8: 1, 4: 1, 3: 9, 2: 1, 1: 1}, 4),      # not at 3 rows: from 4 on only
    ({64: 1, 16: 1, 8: 1, 4: 1, 3: 1, 2: 1, 1: 1.96}, 2),   # within the margin at 1 row
    ({64: 9, 16: 1, 8: 1, 4: 1, 3: 1, 2: 1, 1: 1}, None),   # slower at many rows: no copy kept
])
def test_tuning_keeps_the_copy_from_where_it_measured_faster(tiny_llama, monkeypatch, onednn_ms, chosen):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama)))
    head = engine.model.lm_head
    calls = iter(())

    def time_call(fn, flush, repeats=10):  # torch's matmul 2 ms at every count, oneDNN's as given
        return next(calls)

    monkeypatch.setattr(linear_tuner, "time_call", time_call)
    calls = iter(t for rows in linear_tuner.HEAD_ROW_COUNTS for t in (2e-3, onednn_ms[rows] * 1e-3))
    report = linear_tuner.tune_cpu_head(engine.model)
    assert report[tuple(head.weight.shape)]["onednn_min_rows"] == chosen
    assert (head.onednn_weight is None) == (chosen is None)
    if chosen is not None:
        assert head.onednn_min_rows == chosen


def test_a_quantized_or_bfloat16_head_is_left_alone(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="bfloat16"))
    assert linear_tuner.tune_cpu_head(engine.model) == {} and engine.model.lm_head.onednn_weight is None
