"""Kernel tests run natively on CUDA, and under Triton's interpreter (numpy, CPU tensors) elsewhere.

TRITON_INTERPRET is read when a function is decorated with @triton.jit, so it is set here, before
the test modules import a kernel. Kernel modules already imported (by an earlier test package) are
imported again. If triton itself came in earlier (transformers imports it through torch._dynamo),
its own jit'd library functions (tl.sum, tl.max, tl.cdiv, ...) were built for the GPU; calls to
them from an interpreted kernel are then routed through the interpreter as well.
"""
from __future__ import annotations

import importlib
import os
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

TRITON_MODULES = (
    "specserve_kernels.kv_cache_triton", "specserve_kernels.paged_attention_decode", "specserve_kernels.paged_attention_extend",
    "specserve_kernels.gemv_triton", "specserve_kernels.rms_norm_triton", "specserve_kernels.rotary_triton", "specserve_kernels.silu_mul_triton",
)


def _use_interpreter() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        def call_interpreted(self, *args, **kwargs):
            return InterpretedFunction(self.fn)(*args, **kwargs)

        JITFunction.__call__ = call_interpreted  # otherwise: "Cannot call @triton.jit'd outside of ..."
    _round_fp8_downcasts_to_nearest()
    for name in TRITON_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])


def _round_fp8_downcasts_to_nearest() -> None:
    """The interpreter narrows a float to float8e4nv by dropping mantissa bits and adding the first
    dropped one without carrying it into the exponent (124.3 becomes 64, not 128; a GPU's
    conversion gives 128); such downcasts go through torch's conversion instead, which rounds to
    nearest even and saturates as the GPU's does."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert_float = interpreter._convert_float
    if getattr(convert_float, "rounds_fp8", False):
        return
    float_types = {tl.float32: (np.float32, torch.float32), tl.float16: (np.float16, torch.float16)}

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in float_types:
            np_type, torch_type = float_types[input_dtype]
            values = torch.from_numpy(np.frombuffer(data.tobytes(), dtype=np_type).copy()).to(torch_type)
            out = values.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return out.reshape(data.shape)
        return convert_float(data, input_dtype, output_dtype, rounding_mode)

    convert.rounds_fp8 = True
    interpreter._convert_float = convert


if not torch.cuda.is_available():
    _use_interpreter()

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def interpret() -> bool:
    return INTERPRET


@pytest.fixture
def device() -> torch.device:
    return torch.device("cpu" if INTERPRET else "cuda")


@pytest.fixture
def tolerances() -> dict[torch.dtype, dict[str, float]]:
    """|kernel - float64 reference| <= atol + rtol * |reference|, by input dtype."""
    return {
        torch.float32: dict(atol=2e-5, rtol=2e-5),
        torch.float16: dict(atol=3e-3, rtol=3e-3),
        torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    }


@pytest.fixture
def rng(request) -> torch.Generator:
    """A generator seeded from the test id: fresh inputs per case, reproducible per run."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@dataclass(slots=True)
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32
    block_tables: torch.Tensor  # [batch, max_blocks] int32, unused entries -1
    max_seqlen_q: int
    max_seqlen_k: int

    def args(self) -> tuple:
        return self.q, self.k_cache, self.v_cache, self.cu_seqlens_q, self.seq_lens, self.block_tables

    def float64_args(self) -> tuple:
        return self.q.double(), self.k_cache.double(), self.v_cache.double(), *self.args()[3:]


@pytest.fixture
def make_paged_batch(device, rng) -> Callable[..., PagedBatch]:
    def make(
        seq_lens: list[int],
        q_lens: list[int],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        fused_qkv: bool = False,  # q as a strided view of a [num_tokens, H + 2 Hkv, D] projection
    ) -> PagedBatch:
        """Random q and caches; each request's blocks are scattered over a pool with spare blocks."""
        assert all(0 <= n <= s for n, s in zip(q_lens, seq_lens))
        blocks_per_seq = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_seq) + 2
        perm = torch.randperm(num_blocks, generator=rng)
        block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
        start = 0
        for b, n in enumerate(blocks_per_seq):
            block_tables[b, :n] = perm[start : start + n]
            start += n
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=rng).to(dtype)
        v_cache = torch.randn(shape, generator=rng).to(dtype)
        num_tokens = sum(q_lens)
        if fused_qkv:
            qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=rng).to(dtype)
            q = qkv.to(device)[:, :num_heads]
        else:
            q = torch.randn(num_tokens, num_heads, head_dim, generator=rng).to(dtype).to(device)
        cu_seqlens_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        cu_seqlens_q[1:] = torch.tensor(q_lens).cumsum(0)
        return PagedBatch(
            q, k_cache.to(device), v_cache.to(device), cu_seqlens_q.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables.to(device),
            max(q_lens), max(seq_lens),
        )

    return make
