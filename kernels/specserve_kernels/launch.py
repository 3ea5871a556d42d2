"""What the kernels' Python wrappers share: argument checks run before a launch, so that a bad
argument fails here with a message naming it rather than inside a kernel as a wrong answer or an
illegal memory access, and the constexpr choices (tile sizes, dot types) made per launch."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256


def interpreted(kernel) -> bool:
    """True when `kernel` runs under TRITON_INTERPRET=1 (numpy on the host, CPU tensors)."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def check_device(kernel, *tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type != "cuda" and not interpreted(kernel):
        raise ValueError(
            f"Triton kernels need CUDA tensors, got {device}; on a CPU use the *_ref functions, "
            "or set TRITON_INTERPRET=1 before importing the kernels"
        )


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {tuple(t.stride())}")


def check_index(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dim(s), got shape {tuple(t.shape)}")
    check_last_dim_contiguous(name, t)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match "
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    if k_cache.dtype not in FLOAT_DTYPES:
        raise ValueError(f"KV cache dtype must be one of {FLOAT_DTYPES}, got {k_cache.dtype}")
    check_last_dim_contiguous("k_cache", k_cache)
    check_last_dim_contiguous("v_cache", v_cache)


@dataclass(slots=True)
class AttentionShape:
    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def group_size(self) -> int:  # query heads per KV head
        return self.num_heads // self.num_kv_heads


def check_paged_attention(
    kernel,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [batch + 1]
    seq_lens: torch.Tensor,  # [batch]
    block_tables: torch.Tensor,  # [batch, max_blocks]
) -> AttentionShape:
    """Validates the arguments shared by every paged attention kernel and returns their sizes."""
    check_device(kernel, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables)
    check_kv_cache(k_cache, v_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must match the KV cache dtype {k_cache.dtype}")
    check_last_dim_contiguous("q", q)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != KV cache head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is above the supported {MAX_HEAD_DIM}")
    check_index("seq_lens", seq_lens, 1)
    check_index("cu_seqlens_q", cu_seqlens_q, 1)
    check_index("block_tables", block_tables, 2)
    batch = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_q must have batch + 1 = {batch + 1} entries, got {cu_seqlens_q.shape[0]}")
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have batch = {batch} rows, got {block_tables.shape[0]}")
    return AttentionShape(batch, num_heads, num_kv_heads, head_dim, block_size)


def dot_config(dtype: torch.dtype, kernel) -> dict:
    """Constexprs for tl.dot: DOT_DTYPE is the operand type (the input type; float32 under the
    interpreter for bfloat16, whose numpy dot multiplies bfloat16 as raw uint16), PRECISION keeps
    float32 inputs off TF32 so float32 attention stays float32-accurate."""
    dot_dtype = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
    if interpreted(kernel) and dtype == torch.bfloat16:
        dot_dtype = tl.float32
    return {"DOT_DTYPE": dot_dtype, "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


@dataclass(slots=True)
class TileConfig:
    block_d: int  # head_dim padded to a power of two >= 16 (tl.dot's minimum)
    block_n: int  # context tokens per K/V tile
    num_stages: int  # software pipelining depth of the K/V loads
    num_warps: int


def tile_config(head_dim: int, dtype: torch.dtype, block_m: int) -> TileConfig:
    """K/V tiles of 64 rows while a row is at most 256 bytes (head_dim 128 in 16-bit), else 32 rows
    and one stage less, so that pipelined K and V tiles stay well inside shared memory; 8 warps
    once the [block_m, block_d] float32 accumulator passes 64 registers a thread."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    wide = block_d * dtype.itemsize > 256
    num_warps = 4 if block_m * block_d <= 64 * 128 else 8
    return TileConfig(block_d, 32 if wide else 64, 2 if wide else 3, num_warps)
