"""Paged causal attention over a flat ragged batch.

One entry point serves prefill, chunked prefill, prefix-cache hits, decode and speculative
verification: request b has q_len_b = cu_seqlens_q[b+1] - cu_seqlens_q[b] new query tokens, which
are the last q_len_b of its seq_lens[b] tokens (their K/V are already in the cache). Query i of
request b sits at position seq_lens[b] - q_len_b + i and attends to every cached position <= it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
    """Torch reference (any device). Decode-only batches run as one padded SDPA call;
    requests with several query tokens run one SDPA call each."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    batch = seq_lens.shape[0]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    lens = seq_lens.tolist()
    out = torch.empty_like(q)
    gqa = num_heads != num_kv_heads

    if all(n == 1 for n in q_lens):  # decode: one padded call
        max_len = max(lens)
        nb = (max_len + block_size - 1) // block_size
        k = k_cache[block_tables[:, :nb].long()].reshape(batch, nb * block_size, num_kv_heads, head_dim)
        v = v_cache[block_tables[:, :nb].long()].reshape(batch, nb * block_size, num_kv_heads, head_dim)
        pos = torch.arange(nb * block_size, device=q.device)
        mask = (pos[None, :] < seq_lens[:, None].to(pos.device))[:, None, None, :]  # [B, 1, 1, L]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(k.dtype),  # [B, H, 1, D]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=gqa,
        )
        return o.squeeze(2).to(q.dtype)

    for b in range(batch):
        start, n, length = int(cu_seqlens_q[b]), q_lens[b], lens[b]
        if n == 0:
            continue
        nb = (length + block_size - 1) // block_size
        blocks = block_tables[b, :nb].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        qpos = torch.arange(length - n, length, device=q.device)
        kpos = torch.arange(length, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]  # [n, length]
        o = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1).to(k.dtype),  # [H, n, D]
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=gqa,
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
