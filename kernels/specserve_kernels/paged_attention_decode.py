"""Paged decode attention (one query token per request) as Triton kernels.

One program serves one (request, KV head) pair and all the query heads that share that KV head
(GQA), so each K/V tile is read from HBM once per group, not once per query head. The group is
padded to 16 rows for tl.dot; decode is bound by KV bandwidth, so the idle rows cost nothing.

Split-KV (flash-decoding): when batch * num_kv_heads programs cannot fill the GPU, a third grid
dim splits each request's context into num_splits ranges of whole tiles. Each split writes its
normalised partial output and log-sum-exp; `_combine_kernel` merges them:
    out = sum_s 2^(lse_s - m) * o_s / sum_s 2^(lse_s - m),  m = max_s lse_s  (log2 domain)
A split whose range is empty (short request) writes lse = -inf and weighs nothing.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specserve_kernels.launch import check_paged_attention, dot_config, tile_config

_MIN_TOKENS_PER_SPLIT = 256  # below this a split saves less than the combine step costs
_MAX_SPLITS = 32


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, tl.num_programs(2))
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + g
    gd_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :], mask=gd_mask, other=0.0)
    q = q.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of scores (log2 domain)
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of 2^(score - m_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_start, tile_end):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = pos < seq_len  # every tile below num_tiles has pos[0] valid, so m_i stays finite
        block = tl.load(block_table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        k_off = block * stride_kb + offset * stride_kt + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block * stride_vb + offset * stride_vt + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        p = p.to(v_cache_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split leaves acc = 0
    out = out_ptr + seq.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
    if SPLIT:
        tl.store(out + split * stride_os, acc, mask=gd_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_lt + head * stride_lh + split, lse, mask=g < GROUP)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=gd_mask)


@triton.jit
def _combine_kernel(
    partial_ptr, lse_ptr, out_ptr,
    num_splits,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + seq * stride_lt + head * stride_lh + s, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty context: every weight 0, output 0
    w = tl.exp2(lse - m)
    mask = (s[:, None] < num_splits) & (d[None, :] < HEAD_DIM)
    o = tl.load(
        partial_ptr + seq.to(tl.int64) * stride_pt + head * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=mask, other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    out_row = out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_row + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def default_num_splits(batch: int, num_kv_heads: int, max_seqlen_k: int, num_sms: int) -> int:
    """Splits per request so that about two programs per SM run, when batch * num_kv_heads alone
    cannot fill the GPU and the contexts are long enough to be worth splitting."""
    programs = batch * num_kv_heads
    if programs == 0 or programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(2 * num_sms, programs)
    by_length = max(1, max_seqlen_k // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def auto_num_splits(batch: int, num_kv_heads: int, seq_lens: torch.Tensor, max_seqlen_k: int | None) -> int:
    """The split count a launch uses on its device (the extend kernel's verifications too)."""
    if seq_lens.device.type != "cuda":
        return 1  # the interpreter runs programs one by one: splitting gains nothing
    num_sms = torch.cuda.get_device_properties(seq_lens.device).multi_processor_count
    if batch * num_kv_heads >= num_sms:
        return 1  # decided without reading seq_lens
    if max_seqlen_k is None:
        max_seqlen_k = int(seq_lens.max())  # a device sync
    return default_num_splits(batch, num_kv_heads, max_seqlen_k, num_sms)


def paged_decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim]: one query per request
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [batch + 1] = arange(batch + 1); checked for shape only
    seq_lens: torch.Tensor,  # [batch] context length incl. the new token
    block_tables: torch.Tensor,  # [batch, max_blocks]
    scale: float,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,  # host-side hint; read from seq_lens (a sync) only if needed
    num_splits: int | None = None,  # None: default_num_splits; 1: no split-KV
    block_n: int | None = None,  # context tokens per K/V tile; None: tile_config's (benchmarks try others)
) -> torch.Tensor:  # [batch, num_heads, head_dim]
    """Any num_splits gives the same answer (each request's tiles are shared out by its own
    seq_len inside the kernel), so a fixed count, e.g. under CUDA graphs, only costs speed."""
    shape = check_paged_attention(_decode_kernel, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables)
    batch = shape.batch
    if q.shape[0] != batch:
        raise ValueError(f"decode takes one query per request: q has {q.shape[0]} rows for batch {batch}")
    if max_seqlen_q is not None and max_seqlen_q != 1:
        raise ValueError(f"decode takes one query per request, got max_seqlen_q={max_seqlen_q}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = auto_num_splits(batch, shape.num_kv_heads, seq_lens, max_seqlen_k)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    block_g = max(16, triton.next_power_of_2(shape.group_size))
    tiles = tile_config(shape.head_dim, q.dtype, block_g)
    if block_n is not None:
        if block_n < 16 or block_n & (block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
        tiles.block_n = block_n
    common = dict(
        GROUP=shape.group_size, HEAD_DIM=shape.head_dim, BLOCK_SIZE=shape.block_size,
        BLOCK_G=block_g, BLOCK_D=tiles.block_d, BLOCK_N=tiles.block_n,
        num_stages=tiles.num_stages, num_warps=tiles.num_warps, **dot_config(q.dtype, _decode_kernel),
    )
    strides = (
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
    )
    qk_scale = scale * math.log2(math.e)
    grid = (batch, shape.num_kv_heads, num_splits)
    if num_splits == 1:
        _decode_kernel[grid](
            q, k_cache, v_cache, block_tables, seq_lens, out, out, qk_scale, *strides,
            out.stride(0), out.stride(1), 0, 0, 0, SPLIT=False, **common,
        )
        return out

    partial = torch.empty(batch, shape.num_heads, num_splits, shape.head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, shape.num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, partial, lse, qk_scale, *strides,
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        SPLIT=True, **common,
    )
    _combine_kernel[(batch, shape.num_heads)](
        partial, lse, out, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=shape.head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=tiles.block_d,
    )
    return out
