"""Steps of several tokens per request as compiled graphs on a CPU: prefill, prefill chunks,
speculative verification, and steps that mix them with decodes (compile_prefill).

backend/model/compiled_decode.py compiles decode steps; every other step ran eagerly, and on a
small model its time is mostly small torch operations as a decode step's was: an 8-token prompt
of the default model (int4, 2 threads) took 43 ms to prefill, 23 ms of them in the int4 products.
Such a step's shape is ragged (requests of different lengths, each with its own causal mask), and
that raggedness is all in attention: every other operation of the forward treats the step's
tokens as rows of one matrix. Attention runs as one torch operator (`specserve::paged_attention`,
kernels/specserve_kernels/paged_attention_cpu.py: the C kernel, which reads the pool through the block tables, or
the torch reference where the kernel does not apply), and the forward is traced around it with
the token count, the requests, their pages and the rows that want logits all dynamic: one graph
for steps that want one row of logits (a prompt's prefill), one for the others (several requests,
or verification's several rows per request), both compiled at start-up. A step of one request
gets a second of no tokens, and block tables at least two pages, so that no size is ever 1 (a
size of 1 would be a graph of its own).

int4 layers choose their dense copies (quantization_dense_rows) by row count inside the operator
the graphs call (backend/model/quantized_linear.py, `int4_product`), so a step of any token count
runs compiled. int8 layers' graphs keep their packed kernels: with int8 copies, steps from a
copy's row count on run eagerly, through it (a branch on the row count in the traced code would
be a condition on the graph).
"""
from __future__ import annotations

import torch

from backend.model.attention import AttentionMetadata
from backend.model.compiled_decode import DecodeAttention, read_text_as_utf8, run_compiled
from backend.model.model import LlamaForCausalLM
from backend.model.quantized_linear import WeightOnlyLinear
from specserve_kernels.paged_attention_cpu import paged_attention_op

GRAPHS = 2  # one row of logits, several
MIN_SIZE = 2  # requests and block table columns are padded to at least this many


class ExtendAttention(DecodeAttention):
    """RoPE and the KV store as decode steps trace them; attention as the operator."""

    name = "torch-extend"

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_op(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale)


def pad(meta: AttentionMetadata) -> None:
    """At least MIN_SIZE requests (the extra ones with no tokens) and table columns (page 0:
    never read, as it lies past every request's length)."""
    tables, missing = meta.block_tables, MIN_SIZE - meta.seq_lens.shape[0]
    if missing > 0:
        meta.cu_seqlens_q = torch.cat([meta.cu_seqlens_q, meta.cu_seqlens_q[-1:].expand(missing)])
        meta.seq_lens = torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(missing)])
        tables = torch.cat([tables, tables.new_zeros(missing, tables.shape[1])])
    if tables.shape[1] < MIN_SIZE:
        tables = torch.cat([tables, tables.new_zeros(tables.shape[0], MIN_SIZE - tables.shape[1])], 1)
    meta.block_tables = tables


class CompiledExtend:
    """The model's forward compiled for steps of several tokens; `run` takes a step's prepared inputs."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        read_text_as_utf8()
        self.model, self.kv_caches = model, kv_caches
        self.attention = ExtendAttention()
        self.forward = torch.compile(model.forward, fullgraph=True)  # sizes marked dynamic in warm_up
        torch._dynamo.config.recompile_limit += GRAPHS  # (as CompiledDecode: the forward's code is shared)
        dense = [m.dense_min_rows for m in model.modules() if isinstance(m, WeightOnlyLinear)
                 and m.dense_weight is not None and not m.dense_in_graphs]
        # steps of this many tokens or more run eagerly, through dense copies the graphs do not use
        self.max_tokens: int | None = min(dense) if dense else None
        self.steps = 0  # steps run compiled
        self.eager_steps = 0  # steps that would have compiled a new graph, run eagerly instead

    def takes(self, num_tokens: int, num_logits: int) -> bool:
        """Whether a step of this many tokens, and rows of logits, runs compiled (a decode step's
        single token and a prefill chunk that wants no logits do not: sizes 0 and 1 are graphs of
        their own)."""
        return num_tokens >= 2 and num_logits >= 1 and (self.max_tokens is None or num_tokens < self.max_tokens)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_indices: torch.Tensor) -> torch.Tensor:  # [num_logits, vocab] float32
        """One step. A step that fits neither graph (a bug) runs eagerly rather than stall every
        request for a compile."""
        pad(meta)
        return run_compiled(self, (input_ids, positions, self.kv_caches, self.attention, meta, logits_indices), "a step")

    def _inputs(self, lengths: list[int], num_logits: int, pages: int, block_size: int):
        """Throw-away inputs: requests of `lengths` new tokens from position 0, with tables of
        `pages` columns (their blocks the first of the pool, which no request holds yet: this runs
        before the first; the rest padding), the last `num_logits` rows wanting logits."""
        tokens, slots, positions, cu, tables, free = sum(lengths), [], [], [0], [], 0
        for n in lengths:
            used = -(-n // block_size)
            table = list(range(free, free + used)) + [0] * (pages - used)
            free += used
            tables.append(table)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(n)]
            positions += range(n)
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(lengths, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
            max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
        ids = torch.arange(tokens) % self.model.args.vocab_size
        return ids, torch.tensor(positions), meta, torch.arange(tokens - num_logits, tokens)

    @torch.inference_mode()
    def warm_up(self, block_size: int) -> None:
        """Compile both graphs now, on throw-away inputs whose dynamic sizes all differ: a 7-token
        prompt wanting one row of logits (2 requests with the padding, tables of 5 pages), then
        requests of 6, 4 and 1 tokens wanting 5 rows (tables of 6 pages)."""
        with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True):  # (see CompiledDecode)
            for lengths, num_logits, pages in (([7], 1, 5), ([6, 4, 1], 5, 6)):
                ids, positions, meta, logits_indices = self._inputs(lengths, num_logits, pages, block_size)
                pad(meta)
                dynamic = [(ids, 0), (positions, 0), (meta.slot_mapping, 0), (meta.cu_seqlens_q, 0),
                           (meta.seq_lens, 0), (meta.block_tables, 0), (meta.block_tables, 1)]
                if num_logits > 1:
                    dynamic.append((logits_indices, 0))
                for tensor, dim in dynamic:
                    torch._dynamo.mark_dynamic(tensor, dim)
                self.forward(ids, positions, self.kv_caches, self.attention, meta, logits_indices)
