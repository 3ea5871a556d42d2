"""The engine with the Triton backend (attention, KV store, RMSNorm and RoPE kernels) gives the
torch backend's greedy tokens (float32; under the interpreter on CPU, natively on CUDA)."""
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from tests.model.test_engine_vs_hf import run_engine


def test_triton_backend_matches_torch_backend(tiny_llama):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [[5, 17, 99, 42, 7], list(range(10, 40)), [200] * 3, list(range(50, 70))]
    max_tokens = [3, 2, 4, 3]  # decode steps enough to cover every kernel: each costs seconds interpreted
    knobs = dict(model=str(tiny_llama), device=device, block_size=8, max_num_batched_tokens=24, num_kv_blocks=64)
    torch_tokens = run_engine(LLMEngine(EngineConfig(attention_backend="torch", **knobs)), prompts, max_tokens)
    engine = LLMEngine(EngineConfig(attention_backend="triton", **knobs))
    assert engine.attention.name == "triton"
    assert engine.model.model.norm.use_triton_kernels and engine.model.model.layers[0].mlp.use_triton_kernels
    assert run_engine(engine, prompts, max_tokens) == torch_tokens


def test_small_batch_kernel_in_every_linear_matches_torch_backend(tiny_llama, monkeypatch):
    """Every linear layer (packed qkv and gate/up, o_proj, down_proj, lm_head) through the Triton
    small-batch kernel wherever a step has few enough rows: the torch backend's greedy tokens.
    On CUDA the engine picks the kernel per shape by timing; here it is forced everywhere."""
    import backend.model.model
    from specserve_kernels.gemv import MAX_ROWS

    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [[5, 17, 99, 42, 7], list(range(10, 40)), [200] * 3]
    max_tokens = [3, 2, 4]
    knobs = dict(model=str(tiny_llama), device=device, block_size=8, max_num_batched_tokens=24, num_kv_blocks=64)
    torch_tokens = run_engine(LLMEngine(EngineConfig(attention_backend="torch", **knobs)), prompts, max_tokens)
    engine = LLMEngine(EngineConfig(attention_backend="triton", **knobs))
    linears = [m for m in engine.model.modules() if isinstance(m, backend.model.model.Linear)]
    assert len(linears) == 4 * len(engine.model.model.layers) + 1  # qkv, o, gate/up, down; lm_head
    for m in linears:
        m.gemv_max_rows = MAX_ROWS
    rows, real_gemv = [], backend.model.model.gemv

    def counted_gemv(x, weight, bias):
        rows.append(x.shape[0])
        return real_gemv(x, weight, bias)

    monkeypatch.setattr(backend.model.model, "gemv", counted_gemv)
    assert run_engine(engine, prompts, max_tokens) == torch_tokens
    assert len(rows) > len(linears) and max(rows) <= MAX_ROWS  # decode steps went through it


def test_linear_tuner_times_every_weight_shape_and_sets_the_layers(tiny_llama):
    """The startup tuner over a real model (on a CPU the kernel runs interpreted, far slower than
    torch's matmul, so it must keep torch's matmul everywhere); its rule, on given times."""
    from backend.model.linear_tuner import ROW_COUNTS, rows_for_gemv, tune_small_batch_linears
    from backend.model.model import Linear

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), attention_backend="triton", num_kv_blocks=16))
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    for m in linears:
        m.gemv_max_rows = 99
    report = tune_small_batch_linears(engine.model)
    assert set(report) == {tuple(m.weight.shape) for m in linears}
    if not torch.cuda.is_available():
        assert all(c["gemv_max_rows"] == 0 for c in report.values()) and all(m.gemv_max_rows == 0 for m in linears)
        assert all(list(c["seconds (torch, gemv) by rows"]) == [ROW_COUNTS[0]] for c in report.values())
    assert rows_for_gemv({1: (2.0, 1.0), 2: (2.0, 1.5), 4: (2.0, 2.5), 8: (2.0, 1.0)}) == 2  # up to the first loss
    assert rows_for_gemv({1: (1.0, 1.0)}) == 0  # a tie keeps torch's matmul


def test_fp8_layers_through_the_small_batch_kernel_match_torch_scaled_product(tiny_llama, monkeypatch):
    """quantization="fp8": every FP8 layer through the Triton kernel wherever a step has few enough
    rows gives the greedy tokens of torch's _scaled_mm everywhere (the two quantize x alike and
    differ only in summation order); the tuner times both for every FP8 shape."""
    import backend.model.quantized_linear
    from backend.model.linear_tuner import tune_small_batch_linears
    from backend.model.quantized_linear import Fp8Linear
    from specserve_kernels.gemv import MAX_ROWS

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    prompts = [[5, 17, 99, 42, 7], list(range(10, 40)), [200] * 3]
    max_tokens = [3, 2, 4]
    knobs = dict(model=str(tiny_llama), device=device, dtype=dtype, quantization="fp8", attention_backend="triton",
                 block_size=8, max_num_batched_tokens=24, num_kv_blocks=64)
    engines = LLMEngine(EngineConfig(**knobs)), LLMEngine(EngineConfig(**knobs))
    fp8_layers = [[m for m in e.model.modules() if isinstance(m, Fp8Linear)] for e in engines]
    assert len(fp8_layers[0]) == 4 * len(engines[0].model.model.layers)  # all but the lm_head
    for scaled, kernel in zip(*fp8_layers):
        scaled.gemv_max_rows, kernel.gemv_max_rows = 0, MAX_ROWS
    rows, real_gemv = [], backend.model.quantized_linear.gemv

    def counted_gemv(x, weight, bias, **kwargs):
        rows.append(x.shape[0])
        return real_gemv(x, weight, bias, **kwargs)

    scaled_tokens = run_engine(engines[0], prompts, max_tokens)
    monkeypatch.setattr(backend.model.quantized_linear, "gemv", counted_gemv)
    assert run_engine(engines[1], prompts, max_tokens) == scaled_tokens
    assert len(rows) > len(fp8_layers[1]) and max(rows) <= MAX_ROWS
    report = tune_small_batch_linears(engines[1].model)
    assert {layer.weight_shape for layer in fp8_layers[1]} <= set(report)
    if not torch.cuda.is_available():  # interpreted: the kernel loses everywhere
        assert all(layer.gemv_max_rows == 0 for layer in fp8_layers[1])
