"""The int4 CPU kernel (kernels/specserve_kernels/int4_cpu.c: its AVX2 build, and its AVX-512 one where the CPU has
it) against its torch reference: the same quantization of x, the same integer products, sums equal
to float32 rounding; the AVX-512 build chosen where it runs; the layout and the operator in a
compiled graph."""
from __future__ import annotations

import pytest
import torch

from specserve_kernels import int4_cpu

pytestmark = pytest.mark.skipif(not int4_cpu.available(), reason="needs an x86 CPU with AVX2 and a C compiler")


@pytest.fixture(params=["avx2", "avx512"])
def kernel(request) -> str:
    """Each kernel this CPU runs."""
    if request.param == "avx512" and int4_cpu.isa() != "avx512":
        pytest.skip("needs a CPU with AVX-512")
    return request.param


def weight(out: int, width: int, rng: torch.Generator):
    codes = torch.randint(0, 16, (out, width), generator=rng)
    scale = (torch.rand(out, width // 32, generator=rng) * 0.02).half()
    minimum = (-torch.rand(out, width // 32, generator=rng) * 0.15).half()
    return codes, scale, minimum


def test_pack_holds_each_block_of_32_codes_in_16_bytes():
    codes = torch.arange(64).remainder(16).view(1, 64)
    qs = int4_cpu.pack(codes)
    assert qs.shape == (1, 32) and qs.dtype == torch.uint8
    assert qs[0, 0] == 0 | (0 << 4) and qs[0, 1] == 1 | (1 << 4) and qs[0, 16] == 0  # code 16 is 0 again
    assert torch.equal(int4_cpu.unpack(qs), codes.to(torch.uint8))


# every remainder of the 4-row tile (AVX2) and of the 8-row one (AVX-512)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 64])
# widths (blocks): 1; 2; 3; 8; 16; 18 (the default model's 576: AVX-512's 16 and a pair); 19; 7 (AVX-512:
# a group of four, a pair and one); 48 (1536); 4 and 12 (groups of four only)
@pytest.mark.parametrize("out, width", [(8, 32), (48, 64), (40, 96), (16, 256), (8, 512), (24, 576), (24, 608),
                                        (8, 224), (576, 1536), (8, 128), (8, 384)])
def test_kernel_equals_reference(rng, kernel, rows, out, width):
    codes, scale, minimum = weight(out, width, rng)
    qs = int4_cpu.pack(codes)
    x = 3 * torch.randn(rows, width, generator=rng)
    got = int4_cpu.int4_linear(x, qs, scale, minimum, kernel)
    expected = int4_cpu.int4_linear_ref(x, qs, scale, minimum)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # (float32 sums in another order)
    # and within the int16 rounding of x of the exact product: each block of x is off by at most
    # half its step per value
    w = (codes.view(out, -1, 32) * scale.float()[..., None] + minimum.float()[..., None]).view(out, width).double()
    _, step, _ = int4_cpu.quantize_blocks(x)
    bound = (step.double().repeat_interleave(32, 1) / 2) @ w.abs().t()
    assert bool(((got.double() - x.double() @ w.t()).abs() <= bound * 1.001 + 1e-5).all())


def test_a_row_is_computed_alike_in_any_batch(rng, kernel):
    """Per-row quantization, and every row's sums in one order: a row's output does not depend on
    the rows beside it (an engine's batch and HF's single request give the same numbers)."""
    codes, scale, minimum = weight(64, 608, rng)
    qs = int4_cpu.pack(codes)
    x = torch.randn(11, 608, generator=rng)
    together = int4_cpu.int4_linear(x, qs, scale, minimum, kernel)
    for i in range(11):
        assert torch.equal(int4_cpu.int4_linear(x[i:i + 1], qs, scale, minimum, kernel), together[i:i + 1])


def test_the_avx512_kernel_runs_where_the_cpu_has_it():
    assert int4_cpu.isa() == ("avx512" if int4_cpu.avx512() else "avx2")


def test_zero_blocks_and_large_values(kernel):
    """A block of zeros has step 0 (no division by it, exact zeros out); a block's largest value
    maps to 32767 steps whatever its size."""
    codes = torch.full((16, 64), 15)
    scale, minimum = torch.ones(16, 2, dtype=torch.float16), torch.full((16, 2), 0.5, dtype=torch.float16)
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.linspace(-3e4, 1e4, 32)
    qs = int4_cpu.pack(codes)
    y = int4_cpu.int4_linear(x, qs, scale, minimum, kernel)
    assert torch.equal(y[0], torch.zeros(16))
    values, step, sums = int4_cpu.quantize_blocks(x)
    assert values[1, 1].min() == -32767 and step[1, 1] == torch.tensor(3e4) / 32767 and step[1, 0] == 0
    torch.testing.assert_close(y, int4_cpu.int4_linear_ref(x, qs, scale, minimum), atol=0, rtol=1e-5)


def test_the_operator_in_a_compiled_graph_equals_the_kernel(rng):
    codes, scale, minimum = weight(32, 64, rng)
    qs = int4_cpu.pack(codes)
    x = torch.randn(3, 64, generator=rng)

    @torch.compile(fullgraph=True)
    def f(x):
        return torch.relu(int4_cpu.int4_linear_op(x * 2, qs, scale, minimum)) + 1

    assert torch.equal(f(x), torch.relu(int4_cpu.int4_linear(x * 2, qs, scale, minimum)) + 1)
