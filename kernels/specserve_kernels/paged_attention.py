"""Paged causal attention over a flat ragged batch.

One entry point serves prefill, chunked prefill, prefix-cache hits, decode and speculative
verification: request b has q_len_b = cu_seqlens_q[b+1] - cu_seqlens_q[b] new query tokens, which
are the last q_len_b of its seq_lens[b] tokens (their K/V are already in the cache). Query i of
request b sits at position seq_lens[b] - q_len_b + i and attends to every cached position <= it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

SHORT_QUERY = 32  # requests with at most this many queries share one padded SDPA call


@dataclass(slots=True)
class ShortQueries:
    """Requests with 1..SHORT_QUERY queries, padded to n_max queries each."""
    token_rows: torch.Tensor  # [R, n_max] row of q per (request, query); padding repeats the last
    valid: torch.Tensor | None  # [R, n_max] bool, False on padding; None when there is none
    block_tables: torch.Tensor  # [R, num_blocks]
    mask: torch.Tensor  # [R, n_max, num_blocks * block_size] True = attend (causal and in range)
    grouped_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # group -> _attend's mask
    page_ids: torch.Tensor | None = None  # block_tables flattened for _gather_pages, made once a step
    decode: bool = False  # every row of q is one request's only query, in order: a decode step


@dataclass(slots=True)
class LongQuery:
    """A request with more than SHORT_QUERY queries (a prefill chunk): attended on its own."""
    start: int  # its first row of q
    num_queries: int
    length: int  # seq_len
    block_tables: torch.Tensor  # [1, num_blocks]
    mask: torch.Tensor  # [1, num_queries, length]
    grouped_masks: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class ReferencePlan:
    """What the reference derives from a step's metadata alone: the same for every layer, so the
    engine computes it once per step (see backend.model.attention.TorchAttention)."""
    short: ShortQueries | None
    long: list[LongQuery]


def plan_reference(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   block_size: int, pool_blocks: int, min_pages: int = 1) -> ReferencePlan:
    """`pool_blocks`: the KV pool's blocks, which bound the ids gathered (padding entries of a table may hold
    any value). `min_pages`: short queries read at least this many pages (masked past their length; the
    tables must have as many columns)."""
    device = seq_lens.device
    starts = cu_seqlens_q[:-1].tolist()
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    lens = seq_lens.tolist()
    short = None
    picked = [b for b, n in enumerate(q_lens) if 1 <= n <= SHORT_QUERY]
    if picked:
        n_max = max(q_lens[b] for b in picked)
        # query i of request b; padding repeats the request's last query and is not written back
        clipped = [[min(i, q_lens[b] - 1) for i in range(n_max)] for b in picked]
        token_rows = torch.tensor([[starts[b] + i for i in row] for b, row in zip(picked, clipped)], device=device)
        q_pos = torch.tensor([[lens[b] - q_lens[b] + i for i in row] for b, row in zip(picked, clipped)], device=device)
        valid = None
        if any(q_lens[b] != n_max for b in picked):
            valid = torch.tensor([[i < q_lens[b] for i in range(n_max)] for b in picked], device=device)
        num_blocks = max(min_pages, (max(lens[b] for b in picked) + block_size - 1) // block_size)
        tables = block_tables.index_select(0, torch.tensor(picked, device=device))[:, :num_blocks]
        k_pos = torch.arange(num_blocks * block_size, device=device)
        short = ShortQueries(token_rows, valid, tables, k_pos <= q_pos[:, :, None],
                             page_ids=tables.reshape(-1).long().clamp(0, pool_blocks - 1),
                             decode=n_max == 1 and len(picked) == len(q_lens) and starts == list(range(len(starts))))
    long = []
    for b, n in enumerate(q_lens):
        if n <= SHORT_QUERY:
            continue
        length = lens[b]
        num_blocks = (length + block_size - 1) // block_size
        q_pos = torch.arange(length - n, length, device=device)
        k_pos = torch.arange(length, device=device)
        long.append(LongQuery(starts[b], n, length, block_tables[b : b + 1, :num_blocks],
                              (k_pos[None, :] <= q_pos[:, None]).unsqueeze(0)))
    return ReferencePlan(short, long)


def _gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, kv_heads, num_blocks * block_size, head_dim] (a head-major view): each row's pages
    in order. Padding entries of a table (past a row's own length, masked) may hold any value:
    they are clamped into the pool. `ids`: that, made already."""
    rows, num_blocks = block_tables.shape
    ids = block_tables.reshape(-1).long().clamp(0, cache.shape[0] - 1) if ids is None else ids
    pages = cache.index_select(0, ids).view(rows, num_blocks * cache.shape[1], *cache.shape[2:])
    return pages.transpose(1, 2)


def _grouped_mask(queries: ShortQueries | LongQuery, group: int) -> torch.Tensor:
    """The mask with each request's n queries repeated for the G heads of a group: [R, 1, G n, L]."""
    mask = queries.grouped_masks.get(group)
    if mask is None:
        rows, n, length = queries.mask.shape
        mask = queries.mask.unsqueeze(1).expand(rows, group, n, length).reshape(rows, 1, group * n, length)
        queries.grouped_masks[group] = mask
    return mask


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, queries: ShortQueries | LongQuery,
            scale: float) -> torch.Tensor:
    """Grouped-query attention without repeating K/V: the G query heads that share a KV head are
    folded into the query length, so every KV head is read once.
    q [R, n, H, D]; k, v [R, KVH, L, D]. Returns [R, n, H, D]."""
    rows, n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads  # query head h reads KV head h // group
    q = q.reshape(rows, n, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [R, KVH, G, n, D]
    q = q.reshape(rows, num_kv_heads, group * n, head_dim).to(k.dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=_grouped_mask(queries, group), scale=scale)
    o = o.view(rows, num_kv_heads, group, n, head_dim).permute(0, 3, 1, 2, 4)  # [R, n, KVH, G, D]
    return o.reshape(rows, n, num_heads, head_dim)


def _attend_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decode: ShortQueries,
                   scale: float) -> torch.Tensor:
    """A decode step (one query per request, q's rows in request order): `_attend` without the
    gather of q's rows, their padding and the scatter back. The G query heads of a KV head are
    adjacent in q, so q's view [R, KVH, G, D] is already grouped."""
    rows, num_heads, head_dim = q.shape
    k = _gather_pages(k_cache, decode.block_tables, decode.page_ids)  # [R, KVH, L, D]
    v = _gather_pages(v_cache, decode.block_tables, decode.page_ids)
    num_kv_heads = k.shape[1]
    grouped = q.view(rows, num_kv_heads, num_heads // num_kv_heads, head_dim).to(k.dtype)
    mask = decode.mask.unsqueeze(1)  # [R, 1, 1, L]: the same for the G heads
    o = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    return o.reshape(rows, num_heads, head_dim).to(q.dtype)


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [batch + 1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor,  # [batch] int32, context length incl. the new tokens
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    scale: float,
    max_seqlen_q: int | None = None,  # unused: the kernels' host-side hints
    max_seqlen_k: int | None = None,
    plan: ReferencePlan | None = None,  # plan_reference(...) of these arguments, when shared
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Torch reference (any device). Requests with a few queries (decodes, speculative
    verification) run as one padded SDPA call; each longer one (a prefill chunk) runs its own."""
    if plan is None:
        plan = plan_reference(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1], k_cache.shape[0])
    out = torch.empty_like(q)
    short = plan.short
    if short is not None and short.decode and not plan.long:
        return _attend_decode(q, k_cache, v_cache, short, scale)
    if short is not None:
        k = _gather_pages(k_cache, short.block_tables, short.page_ids)  # [R, KVH, L, D]
        v = _gather_pages(v_cache, short.block_tables, short.page_ids)
        o = _attend(q[short.token_rows], k, v, short, scale)  # [R, n_max, H, D]
        if short.valid is None:
            out.index_copy_(0, short.token_rows.flatten(), o.flatten(0, 1).to(q.dtype))
        else:
            out[short.token_rows[short.valid]] = o[short.valid].to(q.dtype)
    for chunk in plan.long:
        k = _gather_pages(k_cache, chunk.block_tables)[:, :, : chunk.length]  # [1, KVH, length, D]
        v = _gather_pages(v_cache, chunk.block_tables)[:, :, : chunk.length]
        rows = slice(chunk.start, chunk.start + chunk.num_queries)
        out[rows] = _attend(q[rows].unsqueeze(0), k, v, chunk, scale)[0].to(q.dtype)
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
    from specserve_kernels.paged_attention_decode import paged_decode_attention
    from specserve_kernels.paged_attention_extend import paged_extend_attention

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
