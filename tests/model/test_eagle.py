"""EAGLE heads (backend/model/eagle.py, backend/speculative/eagle_proposer.py): the head's logits equal its
definition computed with HF transformers' own Llama layer on HF's hidden states (fused features from
several target layers too); speculation with a head stays greedy-identical to plain decoding
(preemption, a reduced vocabulary, tensor parallelism, fused features) and samples the target's
exact distribution; bad heads and configs are refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.errors import ValidationError
from backend.model.attention import TorchAttention
from backend.model.model_loader import load_eagle_head, load_model
from backend.model.model_runner import ModelRunner, StepInput
from tests.conftest import write_tiny_model
from tests.model.test_engine_vs_hf import mixed_prompts, run_engine
from tests.model.test_speculative import assert_speculation_follows_target


def write_eagle_head(target: Path, out: Path, seed: int = 0, final_norm: bool = True,
                     token_ids: list[int] | None = None, scale: float = 0.05,
                     feature_layers: tuple[int, ...] = ()) -> Path:
    """A head for `target` in the format scripts/train_eagle_draft.py saves, random weights; with
    feature_layers, fused features from those target layers."""
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 1
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    rows = len(token_ids) if token_ids is not None else config["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g) * scale  # noqa: E731
    weights = {
        "fc.weight": randn(hidden, 2 * hidden), "fc.bias": randn(hidden),
        "layer.self_attn.q_proj.weight": randn(heads * head_dim, hidden),
        "layer.self_attn.k_proj.weight": randn(kv_heads * head_dim, hidden),
        "layer.self_attn.v_proj.weight": randn(kv_heads * head_dim, hidden),
        "layer.self_attn.o_proj.weight": randn(hidden, heads * head_dim),
        "layer.mlp.gate_proj.weight": randn(inter, hidden), "layer.mlp.up_proj.weight": randn(inter, hidden),
        "layer.mlp.down_proj.weight": randn(hidden, inter),
        "layer.input_layernorm.weight": 1 + randn(hidden), "layer.post_attention_layernorm.weight": 1 + randn(hidden),
        "lm_head.weight": randn(rows, hidden) * 20,
    }
    if final_norm:
        weights["norm.weight"] = 1 + randn(hidden)
    if feature_layers:
        weights["fuse.weight"] = randn(hidden, (len(feature_layers) + 1) * hidden) * 10
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors")
    if token_ids is not None:
        save_file({"token_ids": torch.tensor(token_ids, dtype=torch.int64)}, out / "draft_vocab.safetensors")
    (out / "config.json").write_text(json.dumps({
        "architecture": "eagle_head", "hidden_size": hidden, "final_norm": final_norm, "decoder_layer": config,
        "feature_layers": list(feature_layers)}))
    return out


@pytest.fixture(scope="module")
def head(tiny_llama, tmp_path_factory) -> Path:
    return write_eagle_head(tiny_llama, tmp_path_factory.mktemp("eagle"))


def eagle_engine(target, head_dir, **knobs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(target), speculative_method="eagle", draft_model=str(head_dir), **knobs))


@pytest.mark.parametrize("final_norm, feature_layers", [(True, ()), (False, ()), (True, (0, 2))])
def test_head_logits_equal_hf_layers_on_hf_hidden_states(tiny_llama, tmp_path, final_norm, feature_layers):
    """The head's first forward over a prompt, reading the features the engine's target wrote,
    gives at every position t the logits of lm_head(norm(LlamaDecoderLayer(fc([embed(x_t+1); g_t]))))
    with HF's own layer (causal) on HF's last_hidden_state f_t: g_t = f_t, or with fused features
    fuse([rms(h_0,t); rms(h_2,t); f_t]) over the outputs of HF's layers 0 and 2 of a 4-layer target."""
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRotaryEmbedding,
    )

    if feature_layers:
        tiny_llama = write_tiny_model(tmp_path / "deeper", "llama", seed=4, num_hidden_layers=4)
    head_dir = write_eagle_head(tiny_llama, tmp_path / "head", seed=3, final_norm=final_norm,
                                feature_layers=feature_layers)
    cpu, prompt = torch.device("cpu"), [5, 9, 200, 17, 3, 3, 40, 11, 64]
    target, _ = load_model(tiny_llama, "float32", cpu, 64)
    head = load_eagle_head(head_dir, target, "float32", cpu, 64)
    pool = torch.zeros(4 * 16 + 1, head.feature_width)
    target.feature_pool = head.feature_pool = pool
    target.feature_layers = head.feature_layers
    runner = ModelRunner(target, TorchAttention(), num_blocks=4, block_size=16, device=cpu, dtype=torch.float32)
    step = StepInput([], [], [], [])
    step.add(prompt, 0, [0], 1)
    runner.run(step)
    head_runner = ModelRunner(head, TorchAttention(), num_blocks=4, block_size=16, device=cpu, dtype=torch.float32)
    step = StepInput([], [], [], [])
    step.add(prompt[1:], 0, [0], len(prompt) - 1)  # position t reads x_{t+1} and f_t
    logits, f_hat = head_runner.run(step)

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    weights = load_file(head_dir / "model.safetensors")
    config = LlamaConfig.from_dict(json.loads((head_dir / "config.json").read_text())["decoder_layer"])
    layer = LlamaDecoderLayer(config, layer_idx=0).eval()
    layer.load_state_dict({k[len("layer."):]: v for k, v in weights.items() if k.startswith("layer.")})
    streams = []
    for i in feature_layers:
        hf.model.layers[i].register_forward_hook(
            lambda module, inputs, out: streams.append((out[0] if isinstance(out, tuple) else out)[0, :-1]))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        f = hf.model(ids).last_hidden_state[0, :-1]  # f_0 .. f_{n-2}
        if feature_layers:
            unit = [h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) for h in streams]
            f = torch.cat([*unit, f], -1) @ weights["fuse.weight"].T
        x = torch.cat([hf.model.embed_tokens(ids[0, 1:]), f], -1) @ weights["fc.weight"].T + weights["fc.bias"]
        n = x.shape[0]
        positions = torch.arange(n)[None]
        mask = torch.full((1, 1, n, n), float("-inf")).triu(1)
        out = layer(x[None], attention_mask=mask, position_ids=positions,
                    position_embeddings=LlamaRotaryEmbedding(config)(x[None], positions))
        expected_hidden = (out[0] if isinstance(out, tuple) else out)[0]
        normed = expected_hidden
        if final_norm:
            variance = expected_hidden.pow(2).mean(-1, keepdim=True)
            normed = expected_hidden * torch.rsqrt(variance + config.rms_norm_eps) * weights["norm.weight"]
        expected = normed @ weights["lm_head.weight"].T
    torch.testing.assert_close(f_hat, expected_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("knobs", [
    {},
    {"num_kv_blocks": 24, "block_size": 8},  # preemption forced
    {"max_num_batched_tokens": 30, "num_speculative_tokens": 6},  # the budget cuts k
    {"tensor_parallel_size": 2},
])
def test_greedy_identical_to_plain_decoding(tiny_llama, head, knobs):
    prompts, max_tokens = mixed_prompts(24, seed=3)
    plain = run_engine(LLMEngine(EngineConfig(model=str(tiny_llama))), prompts, max_tokens)
    engine = eagle_engine(tiny_llama, head, adaptive_speculation=False, **knobs)
    try:
        assert run_engine(engine, prompts, max_tokens) == plain  # also checks free == total blocks
        stats = engine.stats()
        assert stats.spec_draft_tokens_total > 0
        if "num_kv_blocks" in knobs:
            assert engine.scheduler.num_preemptions > 0
    finally:
        engine.close()


@pytest.mark.parametrize("knobs", [{}, {"tensor_parallel_size": 2}])
def test_fused_features_greedy_identical_to_plain_decoding(tmp_path, knobs):
    """A head whose features fuse the residual streams after target layers 0 and 2 of 4."""
    target = write_tiny_model(tmp_path / "t", "llama", seed=4, num_hidden_layers=4)
    head_dir = write_eagle_head(target, tmp_path / "head", seed=2, feature_layers=(0, 2))
    prompts, max_tokens = mixed_prompts(16, seed=5)
    plain = run_engine(LLMEngine(EngineConfig(model=str(target))), prompts, max_tokens)
    engine = eagle_engine(target, head_dir, adaptive_speculation=False, **knobs)
    try:
        assert engine.model.feature_pool.shape[1] == 3 * engine.model.args.hidden_size
        assert run_engine(engine, prompts, max_tokens) == plain
        assert engine.stats().spec_draft_tokens_total > 0
    finally:
        engine.close()


@pytest.mark.parametrize("reduced", [False, True])
def test_sampling_matches_the_target_distribution(tmp_path, reduced):
    """With a head that drafts poorly, the 2nd and 3rd generated tokens follow the target's exact
    marginals (HF, by enumeration); with a head over 5 of the 8 tokens too (q is 0 outside them)."""
    vocab, trials, prompt = 8, 800, [3, 5, 4]
    target = write_tiny_model(tmp_path / "t", "llama", seed=11, vocab_size=vocab, initializer_range=0.6)
    head_dir = write_eagle_head(target, tmp_path / "head", seed=5, token_ids=[0, 2, 3, 5, 6] if reduced else None,
                                scale=0.3)
    engine = eagle_engine(target, head_dir, adaptive_speculation=False, num_speculative_tokens=2)
    assert_speculation_follows_target(engine, target, prompt, vocab, trials)


def _broken(head: Path, tmp_path: Path, change) -> Path:
    out = tmp_path / "broken"
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        (out / name).write_bytes((head / name).read_bytes())
    change(out)
    return out


def _edit_config(**values):
    def change(out: Path) -> None:
        config = json.loads((out / "config.json").read_text())
        config.update(values)
        (out / "config.json").write_text(json.dumps(config))
    return change


def _drop_weight(out: Path) -> None:
    weights = load_file(out / "model.safetensors")
    del weights["fc.bias"]
    save_file(weights, out / "model.safetensors")


@pytest.mark.parametrize("change, message", [
    (lambda out: (out / "config.json").unlink(), "not an EAGLE head"),
    (_edit_config(architecture="LlamaForCausalLM"), "not an EAGLE head"),
    (lambda out: (out / "config.json").write_text("{"), "not an EAGLE head"),
    (_drop_weight, "weights missing"),
    (_edit_config(feature_layers=[1]), "feature_layers \\[1\\] must be increasing target layers in \\[0, 1\\)"),
    (_edit_config(feature_layers=[0, 0]), "feature_layers"),
    (_edit_config(feature_layers="0"), "feature_layers"),
])
def test_a_bad_head_is_a_startup_error_naming_draft_model(tiny_llama, head, tmp_path, change, message):
    with pytest.raises(ValidationError, match=f"draft_model: {message}"):
        eagle_engine(tiny_llama, _broken(head, tmp_path, change))


def test_a_head_of_another_width_is_refused(tiny_llama, bad_draft, tmp_path):
    with pytest.raises(ValidationError, match="draft_model: an EAGLE head of width 32 cannot read"):
        eagle_engine(tiny_llama, write_eagle_head(bad_draft, tmp_path / "narrow"))


@pytest.mark.parametrize("knobs, field", [({"async_scheduling": True}, "async_scheduling"),
                                          ({"pipeline_parallel_size": 2}, "speculative_method"),
                                          ({"draft_model": None}, "draft_model")])
def test_configs_an_eagle_head_cannot_run_are_refused(tiny_llama, head, knobs, field):
    with pytest.raises(ValidationError, match=f"^{field}: "):
        EngineConfig(**{"model": str(tiny_llama), "speculative_method": "eagle", "draft_model": str(head)} | knobs)


def test_a_shared_block_head_brings_its_features_along(tiny_llama, head):
    """The head reads the target's features by KV slot: a prompt that shares the head of a cached
    block gets those positions' features copied with their K/V, so the head's catch-up reads what
    the target computed there, and the output stays plain decoding's."""
    from backend.sampling_params import SamplingParams

    engine = eagle_engine(tiny_llama, head, block_size=8, adaptive_speculation=False)
    try:
        prompt = list(range(10, 45))  # 4 full blocks, then 3 tokens that the answer's 5 join
        first = run_engine(engine, [prompt], [8])
        made, take = [], engine.block_manager.take_copies
        engine.block_manager.take_copies = lambda requests: made.extend(take(requests)) or made[-1:]
        engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        second = [t for out in engine.step() for t in out.token_ids]
        [(source, destination, n)] = made
        pool = engine.runner.model.feature_pool
        assert n == 2 and pool[source * 8 : source * 8 + n].abs().sum() > 0
        assert torch.equal(pool[destination * 8 : destination * 8 + n], pool[source * 8 : source * 8 + n])
        while engine.has_unfinished_requests():
            second += [t for out in engine.step() for t in out.token_ids]
    finally:
        engine.close()
    assert first == [run_engine(LLMEngine(EngineConfig(model=str(tiny_llama))), [prompt], [8])[0]]
    assert second == first[0]
