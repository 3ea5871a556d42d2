"""The C kernels' operators implemented in C++ (kernels/specserve_kernels/cpu_ops.cpp): chosen where they build,
the same results as the Python functions they stand for (the same kernels), both branches of
int4_product, and a clear error for inputs they do not take."""
from __future__ import annotations

import pytest
import torch

from backend.model import quantized_linear
from backend.model.quantized_linear import Int4Linear
from specserve_kernels import int4_cpu, paged_attention_cpu

pytestmark = pytest.mark.skipif(not int4_cpu.available(), reason="needs an x86 CPU with AVX2 and a C compiler")


def layer(out: int = 96, width: int = 576) -> Int4Linear:
    rng = torch.Generator().manual_seed(0)
    return Int4Linear(torch.randn(out, width, generator=rng) * 0.05, None, 32)


def test_the_operators_are_implemented_in_cpp_where_it_builds():
    assert (int4_cpu.IMPLEMENTATION, paged_attention_cpu.IMPLEMENTATION, quantized_linear.INT4_PRODUCT) == ("c++",) * 3


@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_int4_operators_equal_the_kernel(rows):
    w = layer()
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    expected = int4_cpu.int4_linear(x, w.qweight, w.step, w.minimum)
    assert torch.equal(int4_cpu.int4_linear_op(x, w.qweight, w.step, w.minimum), expected)
    assert torch.equal(quantized_linear.int4_product_op(x, w.qweight, w.step, w.minimum, -1, 0), expected)
    # a non-contiguous x is made contiguous, as the Python function does
    wide = torch.randn(rows, 1152, generator=torch.Generator().manual_seed(rows))[:, ::2]
    assert torch.equal(int4_cpu.int4_linear_op(wide, w.qweight, w.step, w.minimum),
                       int4_cpu.int4_linear(wide, w.qweight, w.step, w.minimum))


def test_int4_product_takes_the_dense_copy_from_its_rows():
    w = layer()
    w.use_dense_from(4)
    x = torch.randn(6, 576, generator=torch.Generator().manual_seed(1))
    for rows in (3, 4, 6):
        got = quantized_linear.int4_product_op(x[:rows], w.qweight, w.step, w.minimum, w.dense_number, 4)
        expected = (quantized_linear.dense_product(x[:rows], w.dense_number) if rows >= 4 else
                    int4_cpu.int4_linear(x[:rows], w.qweight, w.step, w.minimum))
        assert torch.equal(got, expected)


def test_inputs_the_operators_do_not_take_raise_an_error():
    w = layer()
    with pytest.raises(RuntimeError, match="int4_linear: x must be"):
        int4_cpu.int4_linear_op(torch.ones(2, 576, dtype=torch.float64), w.qweight, w.step, w.minimum)
    with pytest.raises(RuntimeError, match="int4_linear: x must be"):
        int4_cpu.int4_linear_op(torch.ones(576), w.qweight, w.step, w.minimum)
    q, k = torch.ones(2, 9, 64), torch.ones(4, 16, 3, 64)
    cu, lens, tables = torch.tensor([0, 2]), torch.tensor([2]), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="paged_attention: q"):
        paged_attention_cpu.paged_attention_op(q.double(), k, k, cu, lens, tables, 0.1)
    with pytest.raises(RuntimeError, match="int4_linear: qs must be"):  # x's width is not the weight's
        int4_cpu.int4_linear_op(torch.ones(2, 544), w.qweight, w.step, w.minimum)
    with pytest.raises(RuntimeError, match="int4_linear: scale and minimum"):
        int4_cpu.int4_linear_op(torch.ones(2, 576), w.qweight, w.step[:-1], w.minimum)
    with pytest.raises(RuntimeError, match="paged_attention: cu_seqlens_q"):  # more tokens than q has
        paged_attention_cpu.paged_attention_op(q, k, k, torch.tensor([0, 5]), lens, tables, 0.1)
