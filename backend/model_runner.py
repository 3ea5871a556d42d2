"""Runs one model over one step's flat ragged batch, against its own paged KV pool.

The batch is flat: every scheduled token of every request, back to back, with
  input_ids[T], positions[T], slot_mapping[T]  (T = tokens this step)
  cu_seqlens_q[B+1], seq_lens[B], block_tables[B, max_blocks]  (B = requests this step)
  logits_indices[L]  rows whose logits are needed (sampling or verification).
The draft model has a runner of its own with the same block tables and its own pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.attention import AttentionBackend, AttentionMetadata
from backend.model import LlamaForCausalLM

PAD_BLOCK = 0  # block id that pads block_tables rows (never read: seq_lens bounds every read)


@dataclass(slots=True)
class StepInput:
    token_ids: list[list[int]]  # per request: the tokens computed this step
    start_positions: list[int]  # per request: position of its first token this step
    block_tables: list[list[int]]  # per request
    num_logits: list[int]  # per request: logits wanted for its last n tokens (0: none)


def kv_cache_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    a = model.args
    return 2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attention: AttentionBackend,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.model = model
        self.attention = attention
        self.device = device
        self.block_size = block_size
        a = model.args
        shape = (num_blocks, block_size, a.num_kv_heads, a.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(a.num_layers)
        ]

    def prepare(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for tokens, start, table, num_logits in zip(
            step.token_ids, step.start_positions, step.block_tables, step.num_logits
        ):
            n = len(tokens)
            input_ids.extend(tokens)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            cu_seqlens.append(cu_seqlens[-1] + n)
            seq_lens.append(start + n)
            logits_indices.extend(range(cu_seqlens[-1] - num_logits, cu_seqlens[-1]))
        max_blocks = max((len(t) for t in step.block_tables), default=1)
        tables = [t + [PAD_BLOCK] * (max_blocks - len(t)) for t in step.block_tables]

        def tensor(x, dtype):
            return torch.tensor(x, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            cu_seqlens_q=tensor(cu_seqlens, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(tables, torch.int32),
            max_seqlen_q=max(len(t) for t in step.token_ids),
            max_seqlen_k=max(seq_lens),
        )
        return tensor(input_ids, torch.int64), tensor(positions, torch.int64), meta, tensor(logits_indices, torch.int64)

    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor:  # [sum(num_logits), vocab] float32
        input_ids, positions, meta, logits_indices = self.prepare(step)
        return self.model(input_ids, positions, self.kv_caches, self.attention, meta, logits_indices)
