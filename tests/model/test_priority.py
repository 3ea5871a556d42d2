"""Request priorities in the engine (vLLM's: lower first): an urgent request is not queued behind a
flood, a pool too small for everyone preempts the flood's requests and not it, and nobody's tokens
depend on the priorities."""
from __future__ import annotations

import pytest

from backend.config import EngineConfig
from backend.core.request import Request
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams
from tests.model.test_engine_vs_hf import mixed_prompts


def flood_then_urgent(model, urgent_priority: int, **knobs) -> tuple[int, dict[str, list[int]], LLMEngine, Request]:
    """32 requests of priority 1 with 40 to 70 token prompts, one step, then an urgent request of
    `urgent_priority`: (steps until its first token, every request's tokens, the engine, the
    urgent request)."""
    engine = LLMEngine(EngineConfig(model=str(model), max_num_batched_tokens=64, **knobs))
    prompts, _ = mixed_prompts(32, seed=8)
    for i, p in enumerate(prompts):
        engine.add_request((p * 3)[: 40 + i % 31], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                                   priority=1), request_id=f"low{i}")
    tokens: dict[str, list[int]] = {}
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.token_ids)
    engine.add_request([5, 6, 7, 8] * 4, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                       priority=urgent_priority), request_id="urgent")
    urgent = engine.requests["urgent"]
    steps = None
    for step in range(1, 10_000):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        if steps is None and tokens.get("urgent"):
            steps = step
        if not engine.has_unfinished_requests():
            break
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    return steps, tokens, engine, urgent


@pytest.mark.parametrize("knobs", [{}, {"num_kv_blocks": 24, "block_size": 8}])  # a pool that must preempt
def test_an_urgent_request_is_not_queued_behind_a_flood(tiny_llama, knobs):
    urgent_steps, tokens, engine, urgent = flood_then_urgent(tiny_llama, urgent_priority=0, **knobs)
    fifo_steps, fifo_tokens, _, _ = flood_then_urgent(tiny_llama, urgent_priority=1, **knobs)
    assert urgent_steps == 1  # admitted with its whole prompt at the next step: its first token then
    assert fifo_steps > 10  # one priority for all: behind the flood's prompts
    assert tokens == fifo_tokens  # priorities move nobody's tokens
    if knobs:  # the flood's requests were preempted, never the urgent one
        assert engine.scheduler.num_preemptions > 0 and urgent.num_preemptions == 0
