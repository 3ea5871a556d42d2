"""Paged causal attention on an x86 CPU (AVX2, FMA), float32: paged_attention_cpu.c.

The torch reference (kernels/specserve_kernels/paged_attention.py) gathers each request's pages into a padded
tensor, builds a mask and calls SDPA: about a dozen torch operations and their buffers per layer,
for what at the default model's sizes (9 query heads over 3 KV heads of 64, a few hundred keys)
is a few microseconds of arithmetic. The kernel reads the keys and values where they lie in the
pool, through the block tables, one query and one KV head per work item, and needs no plan made
on the host: a decode step, a prefill, a verification and a mix of them are one call.

    paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)
        the reference's contract; the kernel where `supports(q, k_cache)` (float32, a head size
        a multiple of 16, an x86 CPU with AVX2 and a C compiler), else the reference itself
    kernel_attention(...)   the same arguments, the kernel without the check

`torch.ops.specserve.paged_attention` is the same as a torch operator, for compiled graphs
(implemented in C++ where kernels/specserve_kernels/cpu_ops.py builds).
"""
from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from specserve_kernels import c_library, cpu_ops
from specserve_kernels.paged_attention import paged_attention_ref

SOURCE = pathlib.Path(__file__).with_suffix(".c")


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel computes this attention (else the torch reference does)."""
    return (q.dtype == k_cache.dtype == torch.float32 and q.device.type == "cpu" and q.shape[-1] % 16 == 0
            and q.shape[1] % k_cache.shape[2] == 0 and available())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """q [tokens, heads, head_dim]; k_cache, v_cache [blocks, block_size, kv_heads, head_dim]
    (contiguous); cu_seqlens_q [batch + 1], seq_lens [batch], block_tables [batch, max_blocks]
    int32 (entries past a request's pages may hold anything: they are not read, and ids outside
    the pool are clamped into it). Returns [tokens, heads, head_dim]."""
    if not supports(q, k_cache):
        return paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)
    return kernel_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)


def kernel_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """`paged_attention` by the kernel, for a caller that has asked `supports` already."""
    q = q.contiguous()
    cu_seqlens_q, seq_lens, block_tables = (_int32(t) for t in (cu_seqlens_q, seq_lens, block_tables))
    out = torch.empty_like(q)
    blocks, block_size, kv_heads, head_dim = k_cache.shape
    _library().paged_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cu_seqlens_q.data_ptr(),
                               seq_lens.data_ptr(), block_tables.data_ptr(), seq_lens.shape[0],
                               block_tables.shape[1], q.shape[1], kv_heads, head_dim, block_size, blocks, scale,
                               out.data_ptr(), torch.get_num_threads())
    return out


def _int32(t: torch.Tensor) -> torch.Tensor:
    # (converted only where needed: a conversion that changes nothing still takes 2 us)
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


@functools.cache
def available() -> bool:
    """Whether the kernel runs here (built now if not cached)."""
    return c_library.runs(_library, "attention runs the torch reference")


@functools.cache
def _library() -> ctypes.CDLL:
    lib = c_library.load(SOURCE)
    lib.paged_attention.restype = None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                                    ptr, ctypes.c_int]
    return lib


# (torch.library.Library rather than the custom_op decorator: see kernels/specserve_kernels/int4_cpu.py)
_LIBRARY = torch.library.Library("specserve", "FRAGMENT")
_LIBRARY.define("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor seq_lens, "
                "Tensor block_tables, float scale) -> Tensor")
IMPLEMENTATION = cpu_ops.implement(_LIBRARY, "paged_attention", paged_attention,
                                   lambda: _library().paged_attention if available() else None)


@torch.library.register_fake("specserve::paged_attention", lib=_LIBRARY)
def _(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    return torch.empty_like(q)


paged_attention_op = torch.ops.specserve.paged_attention.default
