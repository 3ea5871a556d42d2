"""Paged extend attention: variable-length causal queries against the paged KV of their own
request. One kernel serves prefill, chunked prefill, prefix-cache hits and speculative
verification, since all are "q_len new tokens at the end of a seq_len-token context".

Grid: (query tile, request, KV head). A tile's BLOCK_M rows are BLOCK_Q consecutive query tokens
times the GROUP query heads that share the KV head (row r = token r // GROUP, head r % GROUP), so
K/V tiles are read once per group. Query i of the request sits at position
seq_len - q_len + i and sees context positions <= it; the KV loop stops after the tile's last
query. Online softmax in the log2 domain, accumulated in float32.

Split-KV, for verification: when every request's queries fit one tile (k + 1 tokens) and
batch * num_kv_heads programs cannot fill the GPU, the first grid dim splits each request's
context into ranges of whole K/V tiles instead, as the decode kernel does
(paged_attention_decode.py: each split writes its normalised partial output and log-sum-exp,
`_combine_kernel` merges them). A query row that sees nothing of a split's range (the range
starts past its position) leaves lse = -inf there and weighs nothing.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specserve_kernels.launch import check_paged_attention, dot_config, tile_config
from specserve_kernels.paged_attention_decode import _combine_kernel, auto_num_splits

_BLOCK_M = 64  # rows (query token, head) per program


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr, lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    if SPLIT:  # one query tile per request; the first grid dim splits its context
        q_tile, split, num_splits = 0, tl.program_id(0), tl.num_programs(0)
    else:
        q_tile, split, num_splits = tl.program_id(0), 0, 1
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - q_len  # position of the first new token

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_idx = q_tile * BLOCK_Q + r // GROUP  # query token within the request
    head = kv_head * GROUP + r % GROUP
    row_valid = (r < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context_start + q_idx  # [BLOCK_M]
    row_off = (q_start + q_idx).to(tl.int64)
    rd_mask = row_valid[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + row_off[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=rd_mask, other=0.0)
    q = q.to(DOT_DTYPE)

    # context this tile sees: up to and including its last query's position; this split's share
    kv_end = context_start + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # a row sees its range's first position
    l_i = tl.zeros([BLOCK_M], tl.float32)  # or none of the range (m_i stays -inf)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_start, tile_end):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        block = tl.load(block_table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        k_off = block * stride_kb + offset * stride_kt + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet: p = 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block * stride_vb + offset * stride_vt + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        p = p.to(v_cache_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that saw nothing keeps acc = 0
    out = out_ptr + row_off[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if SPLIT:
        tl.store(out + split * stride_os, acc, mask=rd_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row_off * stride_lt + head * stride_lh + split, lse, mask=row_valid)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rd_mask)


def paged_extend_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [batch + 1] prefix sums of query lengths
    seq_lens: torch.Tensor,  # [batch] context length incl. the new tokens
    block_tables: torch.Tensor,  # [batch, max_blocks]
    scale: float,
    max_seqlen_q: int | None = None,  # host-side hint (an upper bound will do); else a sync
    max_seqlen_k: int | None = None,  # host-side hint for split-KV; read from seq_lens only if needed
    num_splits: int | None = None,  # None: split-KV where it pays (short queries, few programs); 1: none
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; rows past cu_seqlens_q[-1] left unset
    """Any num_splits gives the same answer (a fixed count, e.g. under CUDA graphs, only costs
    speed); more than one needs every request's queries in one tile (max_seqlen_q <= BLOCK_Q)."""
    shape = check_paged_attention(_extend_kernel, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if shape.batch == 0 or q.shape[0] == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_q == 0:
        return out
    block_m = max(_BLOCK_M, triton.next_power_of_2(shape.group_size))
    block_q = block_m // shape.group_size
    if num_splits is None:
        num_splits = auto_num_splits(shape.batch, shape.num_kv_heads, seq_lens, max_seqlen_k) \
            if max_seqlen_q <= block_q else 1
    if num_splits < 1 or (num_splits > 1 and max_seqlen_q > block_q):
        raise ValueError(f"num_splits {num_splits}: must be >= 1, and 1 when queries ({max_seqlen_q}) "
                         f"exceed a tile ({block_q})")
    tiles = tile_config(shape.head_dim, q.dtype, block_m)
    common = dict(
        GROUP=shape.group_size, HEAD_DIM=shape.head_dim, BLOCK_SIZE=shape.block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=tiles.block_d, BLOCK_N=tiles.block_n,
        num_stages=tiles.num_stages, num_warps=tiles.num_warps, **dot_config(q.dtype, _extend_kernel),
    )
    args = (
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
    )
    strides = (
        scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
    )
    if num_splits == 1:
        grid = (triton.cdiv(max_seqlen_q, block_q), shape.batch, shape.num_kv_heads)
        _extend_kernel[grid](*args, out, out, *strides, out.stride(0), out.stride(1), 0, 0, 0, SPLIT=False, **common)
        return out

    num_tokens = q.shape[0]
    partial = torch.empty(num_tokens, shape.num_heads, num_splits, shape.head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_tokens, shape.num_heads, num_splits, dtype=torch.float32, device=q.device)
    _extend_kernel[(num_splits, shape.batch, shape.num_kv_heads)](
        *args, partial, lse, *strides, partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), SPLIT=True, **common,
    )
    _combine_kernel[(num_tokens, shape.num_heads)](
        partial, lse, out, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=shape.head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=tiles.block_d,
    )
    return out
