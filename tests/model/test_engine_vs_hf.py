"""The engine against HF transformers' generate: greedy output must be token-identical."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams


def hf_greedy(model_dir, prompt: list[int], max_new_tokens: int) -> list[int]:
    key = (str(model_dir), tuple(prompt), max_new_tokens)
    if key not in _hf_outputs:
        _hf_outputs[key] = _hf_greedy(model_dir, prompt, max_new_tokens)
    return _hf_outputs[key]


_hf_outputs: dict = {}


def _hf_greedy(model_dir, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy continuation with EOS ignored (like the engine's ignore_eos)."""
    model = _hf_models.get(str(model_dir))
    if model is None:
        model = _hf_models[str(model_dir)] = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt):].tolist()


_hf_models: dict = {}


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
        for p, m in zip(prompts, max_tokens)
    ]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finished.add(out.request_id)
    assert finished == set(ids)
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    return [tokens[i] for i in ids]


def mixed_prompts(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(1, 70))] for _ in range(n)]
    return prompts, [rng.randint(1, 24) for _ in range(n)]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_single_request_matches_hf(arch, request):
    model_dir = request.getfixturevalue(arch)
    engine = LLMEngine(EngineConfig(model=str(model_dir)))
    prompt = [5, 17, 99, 42, 7, 150, 3, 88, 21]
    assert run_engine(engine, [prompt], [32]) == [hf_greedy(model_dir, prompt, 32)]


@pytest.mark.parametrize(
    "arch,knobs",
    [
        ("tiny_llama", {}),
        ("tiny_qwen2", {}),
        ("tiny_llama", {"max_num_batched_tokens": 24}),  # chunked prefill forced
        ("tiny_llama", {"num_kv_blocks": 24, "block_size": 8}),  # preemption forced
        ("tiny_qwen2", {"num_kv_blocks": 20, "block_size": 8, "max_num_batched_tokens": 40}),
    ],
)
def test_batch_of_32_matches_hf(arch, knobs, request):
    model_dir = request.getfixturevalue(arch)
    engine = LLMEngine(EngineConfig(model=str(model_dir), **knobs))
    prompts, max_tokens = mixed_prompts(32)
    got = run_engine(engine, prompts, max_tokens)
    expected = [hf_greedy(model_dir, p, m) for p, m in zip(prompts, max_tokens)]
    assert got == expected
    if "num_kv_blocks" in knobs:
        assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_hit_gives_same_tokens(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8))
    prefix = list(range(10, 42))  # 4 full blocks
    first = run_engine(engine, [prefix + [50, 51]], [8])
    hits_before = engine.block_manager.prefix_hit_tokens
    second = run_engine(engine, [prefix + [60, 61, 62]], [8])
    assert engine.block_manager.prefix_hit_tokens - hits_before == 32
    assert second == [hf_greedy(tiny_llama, prefix + [60, 61, 62], 8)]
    assert first == [hf_greedy(tiny_llama, prefix + [50, 51], 8)]


def test_a_request_finished_in_its_prefill_step_leaves_its_blocks_cached(tiny_llama):
    """max_tokens=1 finishes a request in the step that computed its prompt: its full blocks
    must still reach the prefix cache, so the same prompt again is mostly a hit."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8))
    prompt = list(range(10, 45))  # 35 tokens: 4 full blocks
    first = run_engine(engine, [prompt], [1])
    hits_before = engine.block_manager.prefix_hit_tokens
    second = run_engine(engine, [prompt], [3])
    assert engine.block_manager.prefix_hit_tokens - hits_before == 32
    assert first == [hf_greedy(tiny_llama, prompt, 1)]
    assert second == [hf_greedy(tiny_llama, prompt, 3)]


@pytest.mark.parametrize("second_tail", [[], [60, 61]])
def test_a_prompt_sharing_the_head_of_a_cached_block_reuses_it_token_by_token(tiny_llama, second_tail):
    """The first request's answer fills its prompt's last block; the same prompt again (or with
    more after it) shares that block's head: those K/V rows are copied into its own block, and
    the output is still HF's."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8))
    prompt = list(range(10, 45))  # 35 tokens: 4 full blocks and 3 in the fifth
    first = run_engine(engine, [prompt], [8])  # the fifth block fills with 5 answer tokens
    hits_before = engine.block_manager.prefix_hit_tokens
    second = run_engine(engine, [prompt + second_tail], [6])
    shared = 3 if second_tail else 2  # the whole prompt again: its last token is computed
    assert engine.block_manager.prefix_hit_tokens - hits_before == 32 + shared
    assert first == [hf_greedy(tiny_llama, prompt, 8)]
    assert second == [hf_greedy(tiny_llama, prompt + second_tail, 6)]
