"""Paged causal attention over a flat ragged batch.

One entry point serves prefill, chunked prefill, prefix-cache hits, decode and speculative
verification: request b has q_len_b = cu_seqlens_q[b+1] - cu_seqlens_q[b] new query tokens, which
are the last q_len_b of its seq_lens[b] tokens (their K/V are already in the cache). Query i of
request b sits at position seq_lens[b] - q_len_b + i and attends to every cached position <= it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[rows, num_blocks * block_size, kv_heads, head_dim]: each row's first pages, in order.
    Padding entries of a table (past a row's own length, masked later) may hold any value."""
    rows = block_tables.shape[0]
    ids = block_tables[:, :num_blocks].reshape(-1).long().clamp(0, cache.shape[0] - 1)
    pages = cache.index_select(0, ids)
    return pages.view(rows, num_blocks * cache.shape[1], *cache.shape[2:])


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [batch + 1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor,  # [batch] int32, context length incl. the new tokens
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    scale: float,
    max_seqlen_q: int | None = None,  # optional host-side hints, avoid a device sync
    max_seqlen_k: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Torch reference (any device). The requests with one query (decodes) run as one padded
    SDPA call; each request with several queries runs one SDPA call of its own."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    block_size = k_cache.shape[1]
    gqa = q.shape[1] != num_kv_heads
    starts = cu_seqlens_q[:-1].tolist()
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    lens = seq_lens.tolist()
    out = torch.empty_like(q)

    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    if decodes:
        rows = torch.tensor(decodes, device=q.device)
        token_rows = torch.tensor([starts[b] for b in decodes], device=q.device)
        nb = (max(lens[b] for b in decodes) + block_size - 1) // block_size
        tables = block_tables.index_select(0, rows)
        k = _gather_pages(k_cache, tables, nb)  # [R, L, kv_heads, head_dim]
        v = _gather_pages(v_cache, tables, nb)
        pos = torch.arange(nb * block_size, device=q.device)
        mask = pos[None, :] < seq_lens.index_select(0, rows)[:, None].to(pos.device)  # [R, L]
        o = F.scaled_dot_product_attention(
            q.index_select(0, token_rows).unsqueeze(2).to(k.dtype),  # [R, H, 1, D]
            k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=gqa,
        )
        out[token_rows] = o.squeeze(2).to(q.dtype)

    for b, n in enumerate(q_lens):
        if n <= 1:
            continue
        start, length = starts[b], lens[b]
        nb = (length + block_size - 1) // block_size
        k = _gather_pages(k_cache, block_tables[b : b + 1], nb)[0, :length]  # [length, kv_heads, D]
        v = _gather_pages(v_cache, block_tables[b : b + 1], nb)[0, :length]
        qpos = torch.arange(length - n, length, device=q.device)
        kpos = torch.arange(length, device=q.device)
        o = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1).to(k.dtype),  # [H, n, D]
            k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=kpos[None, :] <= qpos[:, None], scale=scale, enable_gqa=gqa,
        )
        out[start : start + n] = o.transpose(0, 1).to(q.dtype)
    return out


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [batch + 1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor,  # [batch] int32, context length incl. the new tokens
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    scale: float,
    max_seqlen_q: int | None = None,  # optional host-side hints, avoid a device sync
    max_seqlen_k: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Triton kernels, same contract as `paged_attention_ref`. A batch where every request has
    exactly one query goes to the decode kernel (split-KV when few programs meet long contexts),
    anything else to the extend kernel. Triton is imported here, on first use, so the reference
    stays importable where Triton is not installed."""
    from kernels.paged_attention_decode import paged_decode_attention
    from kernels.paged_attention_extend import paged_extend_attention

    batch = seq_lens.shape[0]
    if max_seqlen_q is None and batch > 0:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    # batch queries, none longer than 1: every request has exactly one
    if batch > 0 and q.shape[0] == batch and max_seqlen_q == 1:
        return paged_decode_attention(
            q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q, max_seqlen_k
        )
    return paged_extend_attention(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q, max_seqlen_k
    )
