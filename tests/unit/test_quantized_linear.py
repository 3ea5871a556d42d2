"""Weight-only quantized linears (backend/model/quantized_linear.py): what they hold, what they
compute, what they replace, and the configuration they refuse."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.errors import ValidationError
from backend.model.model import Linear
from backend.model.linear_swap import HEAD_CANDIDATES, RescoredHead, quantize_linears, swap_linears
from backend.model.quantized_linear import Fp8Linear, Int4Linear, Int8Linear, dense_dtype, onednn_bfloat16
from backend.model.tensor_parallel import RowParallelLinear
from specserve_kernels import int4_cpu


def q4_1_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Weights as GGUF's Q4_1 blocks of 32 dequantize: q * d + m with float16 d and m, q in 0..15
    and every block using both ends of its range."""
    g = torch.randn(rows, cols // 32, 32, generator=torch.Generator().manual_seed(seed))
    low = g.amin(-1)
    step = ((g.amax(-1) - low) / 15).half().float()
    low = low.half().float()
    q = ((g - low[..., None]) / step[..., None]).round().clamp(0, 15)
    return (q * step[..., None] + low[..., None]).view(rows, cols), step


@pytest.fixture(params=["blocks", "int4pack"])
def int4_layout(request, monkeypatch) -> str:
    """int4 layers in the int4 CPU kernel's blocks (where it runs here) and in torch's packed layout
    (where it does not)."""
    if request.param == "blocks" and not int4_cpu.available():
        pytest.skip("the int4 CPU kernel does not run here")
    if request.param == "int4pack":
        monkeypatch.setattr(int4_cpu, "available", lambda: False)
    return request.param


def test_int4_holds_q4_1_weights(int4_layout):
    """In blocks (float16 steps and minimums, as Q4_1's) to float32 rounding; in torch's layout to the
    bfloat16 rounding of each group's scale and zero."""
    w, step = q4_1_weight(40, 128)  # 40 rows: padded to 48 inside torch's layout, sliced off again
    layer = Int4Linear(w, None, 32)
    assert layer.layout == int4_layout
    back = layer.dequantized_weight()
    assert back.shape == w.shape
    codes = layer.codes()
    assert codes.min() >= 0 and codes.max() <= 15 and torch.equal(codes, codes.round())
    err = (back - w).abs().view(40, 4, 32).amax(-1)
    if int4_layout == "blocks":
        torch.testing.assert_close(back, w, atol=1e-6, rtol=1e-6)
        return
    # bfloat16 keeps 8 significant bits: each group's zero (a value about the size of its weights)
    # and step are off by at most half a unit there, and the codes are rounded against them
    bound = w.abs().view(40, 4, 32).amax(-1) * 2**-8 + 15 * step * 2**-8
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) < float(step.min()) / 2  # every weight is nearer its own code than the next


def test_int4_forward_is_the_kernels_product_with_its_dequantized_weight(int4_layout):
    """In blocks: the int4 CPU kernel's product (x's blocks of 32 in int16), a group of 64 held as
    two blocks with its own step and minimum; in torch's layout the bfloat16 product."""
    w, _ = q4_1_weight(64, 96 * 2)
    bias = torch.randn(64)
    layer = Int4Linear(w, bias, 64)
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(2))
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (5, 64)
    if int4_layout == "blocks":
        assert torch.equal(layer.step[:, 0::2], layer.step[:, 1::2])
        expected = int4_cpu.int4_linear_ref(x, layer.qweight, layer.step, layer.minimum) + bias
        # float32 sums in another order (the AVX-512 build adds 16 lanes where the reference adds
        # block by block): over 300 random inputs the two differed by at most 3.1e-5
        torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)
    else:
        expected = x.bfloat16().float() @ layer.dequantized_weight().t() + bias
        torch.testing.assert_close(y, expected, atol=0.05, rtol=0.02)  # the kernel's output is bfloat16
    torch.testing.assert_close(layer(x.view(1, 5, 192))[0], y)  # leading dims are flattened


def test_int8_rows_are_within_half_their_step_and_no_worse_than_max_scaling():
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    w[:8] = w[:8].clamp(-1, 1) + torch.sign(w[:8]) * 0.4  # rows of many large weights: clipping may pay
    layer = Int8Linear(w, None)
    scale = layer.scale.float()
    err = (layer.dequantized_weight() - w).abs()
    inside = w.abs() <= 127 * scale[:, None]
    assert bool((err[inside] <= (scale[:, None] / 2 * (1 + 2**-7)).expand_as(w)[inside]).all())
    plain = (w.abs().amax(1) / 127).bfloat16().float()  # max scaling, at the kernel's precision
    plain_err = ((w / plain[:, None]).round() * plain[:, None] - w).pow(2).sum(1)
    assert bool((err.pow(2).sum(1) <= plain_err * (1 + 1e-5)).all())
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), x.bfloat16().float() @ layer.dequantized_weight().t(), atol=0.1, rtol=0.02)


@pytest.mark.parametrize("mode, kind", [("int4", Int4Linear), ("int8", Int8Linear)])
def test_the_lm_head_rescores_its_best_candidates_exactly(mode, kind):
    """An lm_head quantized like the layers: its logits pick the candidates, the float weight
    scores them, so the argmax is float's even where the quantized logits alone get it wrong."""
    torch.manual_seed(0)
    weight = torch.randn(512, 64) * 0.05
    model = nn.ModuleDict({"proj": nn.Linear(64, 32), "lm_head": nn.Linear(64, 512, bias=False)})
    model["lm_head"].weight.data = weight.clone()
    swap_linears(model, mode, 32)
    head = model["lm_head"]
    assert isinstance(head, RescoredHead) and isinstance(head.quantized, kind) and isinstance(model["proj"], kind)
    x = torch.randn(200, 64) * 4
    exact, quantized, rescored = x @ weight.t(), head.quantized(x), head(x)
    top = quantized.topk(HEAD_CANDIDATES, dim=-1).indices  # the candidates
    torch.testing.assert_close(rescored.gather(-1, top), exact.gather(-1, top), atol=1e-4, rtol=1e-5)
    others = torch.ones_like(rescored, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(rescored[others], quantized[others])
    assert torch.equal(rescored.argmax(-1), exact.argmax(-1))
    if mode == "int4":
        assert not torch.equal(quantized.argmax(-1), exact.argmax(-1))  # what rescoring fixes
    assert head(x.view(10, 20, 64)).shape == (10, 20, 512)


def test_every_linear_multiplies_through_its_quantized_layer_and_keeps_its_forward():
    """The model's own Linear and the tensor-parallel layers keep their forward (a row-parallel
    layer still all-reduces); a tied lm_head gets its own copy and the embedding table stays."""
    torch.manual_seed(0)
    reduced = []
    embed = nn.Embedding(64, 32)
    model = nn.ModuleDict({
        "embed": embed, "proj": Linear(32, 48, bias=True), "head": Linear(32, 64, bias=False),
        "row": RowParallelLinear(32, 16, True, 0, reduced.append),
    })
    model["head"].weight = embed.weight
    embed_before = embed.weight.detach().clone()
    x = torch.randn(3, 32)
    float_out = {name: model[name](x) for name in ("proj", "head", "row")}
    reduced.clear()
    read = quantize_linears(model, "int8")
    assert model["embed"] is embed and torch.equal(embed.weight, embed_before)
    for name in ("proj", "head", "row"):
        layer = model[name]
        assert isinstance(layer.quantized, Int8Linear) and layer.weight is None and layer.bias is None
        torch.testing.assert_close(layer(x), float_out[name], atol=0.05, rtol=0.05)
    assert len(reduced) == 1  # the row-parallel layer's all-reduce ran
    assert read == sum(b.numel() * b.element_size() for n in ("proj", "head", "row") for b in model[n].buffers())
    assert read < (48 + 64 + 16) * 32 * 4 / 3  # about a quarter of the float32 bytes, plus scales and biases
    untouched = nn.ModuleDict({"proj": Linear(32, 48, bias=False)})
    assert quantize_linears(untouched, "none") == 0 and untouched["proj"].quantized is None


def test_swap_linears_replaces_torch_linears():
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 32, bias=False))
    swap_linears(model, "int8")
    assert isinstance(model[0], Int8Linear) and isinstance(model[2], Int8Linear)
    assert model(torch.randn(2, 32)).shape == (2, 32)


def test_fp8_holds_row_scaled_weights_and_multiplies_fp8_rows():
    """FP8 weights with one scale per row (its absolute maximum maps to 448) and the input's rows
    quantized per call: torch's _scaled_mm equals the FP8 product written out, and is within FP8's
    error of the float product."""
    from specserve_kernels.gemv import gemv_fp8_ref

    g = torch.Generator().manual_seed(5)
    w, bias = torch.randn(48, 64, generator=g) / 8, torch.randn(48, generator=g)
    layer = Fp8Linear(w, bias)
    assert layer.qweight.dtype == torch.float8_e4m3fn and layer.scale.dtype == torch.float32
    torch.testing.assert_close(layer.qweight.float().abs().amax(1), torch.full((48,), 448.0))
    assert ((layer.dequantized_weight() - w).abs() <= w.abs() / 16 + layer.scale[:, None] * 2**-9).all()
    x = torch.randn(5, 64, generator=g)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (5, 48)
    torch.testing.assert_close(y, gemv_fp8_ref(x, layer.qweight, layer.scale, layer.bias), atol=1e-5, rtol=1e-5)
    assert 0 < float((y - (x @ w.t() + bias)).abs().max()) < 0.2
    torch.testing.assert_close(layer(x.view(1, 5, 64))[0], y)  # leading dims are flattened
    assert layer(x[:0]).shape == (0, 48)


def test_fp8_leaves_the_lm_head_and_refuses_widths_off_its_multiple():
    model = nn.ModuleDict({"proj": Linear(32, 48, bias=True), "lm_head": Linear(32, 64, bias=False)})
    read = quantize_linears(model, "fp8")
    assert isinstance(model["proj"].quantized, Fp8Linear) and model["lm_head"].quantized is None
    assert read == 48 * 32 + 48 * 4  # one byte a weight and a float32 scale per row
    hf = swap_linears(nn.ModuleDict({"proj": nn.Linear(32, 48), "lm_head": nn.Linear(32, 64)}), "fp8")
    assert isinstance(hf["proj"], Fp8Linear) and type(hf["lm_head"]) is nn.Linear
    with pytest.raises(ValidationError) as e:
        Fp8Linear(torch.randn(40, 32), None)
    assert e.value.field == "quantization" and "multiples of 16" in e.value.message and "(40, 32)" in e.value.message


@pytest.mark.parametrize("values, field", [
    ({"quantization": "int3"}, "quantization"),
    ({"quantization": "fp4"}, "quantization"),
    ({"quantization": "int4", "quantization_group_size": "48"}, "quantization_group_size"),
    ({"quantization": "int4", "quantization_dense_rows": "-2"}, "quantization_dense_rows"),
    ({"quantization": "int4", "quantization_dense_rows": "many"}, "quantization_dense_rows"),
])
def test_bad_quantization_is_refused_by_name(tiny_llama, values, field):
    with pytest.raises(ValidationError) as e:
        EngineConfig.from_strings({"model": str(tiny_llama), **values})
    assert e.value.field == field


def test_a_group_size_that_does_not_divide_a_layer_is_refused():
    with pytest.raises(ValidationError) as e:
        Int4Linear(torch.randn(16, 96), None, 64)
    assert e.value.field == "quantization_group_size" and "96" in e.value.message


@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
def test_a_layer_multiplies_by_its_dense_copy_from_its_row_count_on(kind):
    """From `dense_min_rows` rows of input the product is the GEMM with the dequantized weight (in
    bfloat16 where oneDNN multiplies it natively, else float32); below, the packed kernel's; None
    drops the copy."""
    w, _ = q4_1_weight(40, 128, seed=2)
    layer = Int8Linear(w, None) if kind is Int8Linear else Int4Linear(w, None, 32)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(3))
    packed = layer(x)
    layer.use_dense_from(8)
    dtype = torch.bfloat16 if onednn_bfloat16() else torch.float32
    assert dense_dtype() == dtype and layer.dense_weight.dtype == dtype and layer.dense_weight.shape == (40, 128)
    dense = (x.to(dtype) @ layer.dequantized_weight().to(dtype).t()).float()
    torch.testing.assert_close(layer(x), dense, rtol=0, atol=0 if dtype == torch.bfloat16 else 1e-4)
    assert torch.equal(layer(x[:7]), packed[:7])  # 7 rows: the packed kernel
    layer.use_dense_from(None)
    assert layer.dense_weight is None and torch.equal(layer(x), packed)


def test_rows_for_dense_is_the_fewest_rows_from_which_dense_always_won():
    from backend.model.linear_tuner import rows_for_dense

    assert rows_for_dense({256: (9.0, 1.0), 128: (4.0, 1.0), 64: (2.0, 1.5), 32: (1.0, 1.2)}) == 64
    assert rows_for_dense({256: (9.0, 1.0), 128: (1.0, 2.0), 64: (2.0, 1.5)}) == 256  # not below a loss
    assert rows_for_dense({256: (1.0, 2.0)}) is None


def test_quantized_layers_are_tuned_at_load_or_set(tiny_llama):
    """quantization_dense_rows 0 times both per weight shape (a row count or None for every
    shape); a row count sets it everywhere; -1 keeps no copy."""
    def engine(rows):
        return LLMEngine(EngineConfig(model=str(tiny_llama), quantization="int4", quantization_dense_rows=rows,
                                      num_threads=1))

    layers = lambda e: [m.quantized.quantized if isinstance(m.quantized, RescoredHead) else m.quantized
                        for m in e.model.modules() if getattr(m, "quantized", None) is not None]
    tuned = engine(0)
    report = tuned.linear_choices["target"]
    assert set(report) == {layer.weight_shape for layer in layers(tuned)}
    for layer in layers(tuned):
        chosen = report[layer.weight_shape]["dense_min_rows"]
        assert (layer.dense_weight is None) == (chosen is None) and layer.dense_min_rows == (chosen or 0)
        assert report[layer.weight_shape]["seconds (packed, dense) by rows"]
    assert all(layer.dense_min_rows == 16 for layer in layers(engine(16)))
    assert all(layer.dense_weight is None for layer in layers(engine(-1)))
