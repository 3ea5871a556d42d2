"""The engine with the Triton backend (attention, KV store, RMSNorm and RoPE kernels) gives the
torch backend's greedy tokens (float32; under the interpreter on CPU, natively on CUDA)."""
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from tests.model.test_engine_vs_hf import run_engine


def test_triton_backend_matches_torch_backend(tiny_llama):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [[5, 17, 99, 42, 7], list(range(10, 40)), [200] * 3, list(range(50, 70))]
    max_tokens = [6, 4, 8, 5]
    knobs = dict(model=str(tiny_llama), device=device, block_size=8, max_num_batched_tokens=24, num_kv_blocks=64)
    torch_tokens = run_engine(LLMEngine(EngineConfig(attention_backend="torch", **knobs)), prompts, max_tokens)
    engine = LLMEngine(EngineConfig(attention_backend="triton", **knobs))
    assert engine.attention.name == "triton"
    assert engine.model.model.norm.use_triton_kernels and engine.model.model.layers[0].self_attn.rotary.use_triton_kernels
    assert run_engine(engine, prompts, max_tokens) == torch_tokens
