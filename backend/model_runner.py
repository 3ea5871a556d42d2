"""Runs one model over one step's flat ragged batch, against its own paged KV pool.

The batch is flat: every scheduled token of every request, back to back, with
  input_ids[T], positions[T], slot_mapping[T]  (T = tokens this step)
  cu_seqlens_q[B+1], seq_lens[B], block_tables[B, max_blocks]  (B = requests this step)
  logits_indices[L]  rows whose logits are needed (sampling or verification).
The draft model has a runner of its own with the same block tables and its own pool.

On CUDA, decode-only steps (one token per request) replay a CUDA graph captured at start-up for
the smallest batch-size bucket that holds the batch; padding rows write nowhere (slot -1) and
read one cached token. Mixed steps run eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.attention import AttentionBackend, AttentionMetadata
from backend.decode_inputs import PAD_BLOCK, PAD_SLOT, DecodeInputs
from backend.model import LlamaForCausalLM

# decode graph buckets: a batch runs in the smallest that holds it, padded; steps of 8, then 16,
# keep the padding (whole rows of every matmul) under 12% from 64 requests up
GRAPH_BATCH_SIZES = (1, 2, 4) + tuple(range(8, 64, 8)) + tuple(range(64, 257, 16))


@dataclass(slots=True)
class StepInput:
    token_ids: list[list[int]]  # per request: the tokens computed this step
    start_positions: list[int]  # per request: position of its first token this step
    block_tables: list[list[int]]  # per request
    num_logits: list[int]  # per request: logits wanted for its last n tokens (0: none)
    # inputs still on the device (sampled last step, or drafts), as (index into the flat
    # input_ids, index into `device_tokens`); token_ids holds 0 there
    device_tokens: torch.Tensor | None = None
    from_device: list[tuple[int, int]] = field(default_factory=list)
    # overlapped speculation: per request, a correction to its positions known only on the device
    # (how many of last step's drafts were rejected, <= 0); start_positions assume all accepted
    position_offsets: torch.Tensor | None = None  # [num_requests] int64

    def add(self, token_ids: list[int], start: int, block_table: list[int], num_logits: int) -> None:
        """One request's tokens at positions start.. (target and draft build their steps alike)."""
        self.token_ids.append(token_ids)
        self.start_positions.append(start)
        self.block_tables.append(block_table)
        self.num_logits.append(num_logits)

    def take_from_device(self, sources: list[int], at: list[int] | None = None) -> None:
        """Tokens `at` (indices into the last request added; default: its last len(sources)) are
        `device_tokens[sources]`."""
        n = len(self.token_ids[-1])
        first = sum(map(len, self.token_ids)) - n
        at = range(n - len(sources), n) if at is None else at
        self.from_device += ((first + i, source) for i, source in zip(at, sources))


@dataclass(slots=True)
class _FlatInputs:
    """One step's inputs as host lists, before they become tensors."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    cu_seqlens: list[int]
    seq_lens: list[int]
    logits_indices: list[int]


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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # batch-size bucket -> decode graph
        self.graph_io: dict[str, torch.Tensor] = {}  # static inputs and outputs shared by all graphs
        self.decode_inputs: DecodeInputs | None = None  # host staging of the graphs' inputs

    def init_decode_inputs(self, max_batch_size: int, max_blocks: int) -> None:
        self.decode_inputs = DecodeInputs(max_batch_size, max_blocks, pin=self.device.type == "cuda")

    @torch.inference_mode()
    def capture_decode_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        """Capture one decode graph per batch-size bucket up to `max_batch_size` (CUDA only)."""
        sizes = [b for b in GRAPH_BATCH_SIZES if b < max_batch_size] + [max_batch_size]
        biggest = max(sizes)
        max_blocks = (max_model_len + self.block_size - 1) // self.block_size
        dev = self.device
        io = self.graph_io = dict(
            input_ids=torch.zeros(biggest, dtype=torch.int64, device=dev),
            positions=torch.zeros(biggest, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((biggest,), PAD_SLOT, dtype=torch.int64, device=dev),
            cu_seqlens_q=torch.arange(biggest + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(biggest, dtype=torch.int32, device=dev),
            block_tables=torch.full((biggest, max_blocks), PAD_BLOCK, dtype=torch.int32, device=dev),
            logits_indices=torch.arange(biggest, dtype=torch.int64, device=dev),
        )
        self.init_decode_inputs(biggest, max_blocks)
        pool = None
        for b in sorted(sizes, reverse=True):  # biggest first: smaller graphs reuse its pool
            meta = AttentionMetadata(
                io["slot_mapping"][:b], io["cu_seqlens_q"][: b + 1], io["seq_lens"][:b],
                io["block_tables"][:b], max_seqlen_q=1, max_seqlen_k=max_model_len,
            )
            args = (io["input_ids"][:b], io["positions"][:b], self.kv_caches, self.attention, meta,
                    io["logits_indices"][:b])
            self.model(*args)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(*args)
            pool = graph.pool()
            io[f"logits_{b}"] = logits
            self.graphs[b] = graph
        torch.cuda.synchronize(dev)

    def _replay(self, step: StepInput) -> torch.Tensor | None:
        """Run a decode-only step through a captured graph; None when no graph fits it."""
        b = len(step.token_ids)
        if not self.graphs or b > max(self.graphs) or any(len(t) != 1 for t in step.token_ids):
            return None
        if step.position_offsets is not None:
            return None
        if any(n != 1 for n in step.num_logits):
            return None
        bucket = min(size for size in self.graphs if size >= b)
        self.decode_inputs.upload(self.graph_inputs(step, bucket), self.graph_io)
        self._fill_from_device(self.graph_io["input_ids"], step)
        self.graphs[bucket].replay()
        return self.graph_io[f"logits_{bucket}"][:b]

    def graph_inputs(self, step: StepInput, bucket: int) -> dict[str, torch.Tensor]:
        """Host tensors for a decode graph of `bucket` rows (after `init_decode_inputs`): the
        step's flat inputs, then padding rows that write nowhere and read one cached token."""
        flat = self._flat_inputs(step)
        return self.decode_inputs.fill(flat.input_ids, flat.positions, flat.slots, flat.seq_lens,
                                       step.block_tables, bucket)

    def _flat_inputs(self, step: StepInput) -> _FlatInputs:
        bs = self.block_size
        flat = _FlatInputs([], [], [], [0], [], [])
        for tokens, start, table, num_logits in zip(
            step.token_ids, step.start_positions, step.block_tables, step.num_logits
        ):
            n = len(tokens)
            flat.input_ids.extend(tokens)
            pos = range(start, start + n)
            flat.positions.extend(pos)
            flat.slots.extend(table[p // bs] * bs + p % bs for p in pos)
            flat.cu_seqlens.append(flat.cu_seqlens[-1] + n)
            flat.seq_lens.append(start + n)
            flat.logits_indices.extend(range(flat.cu_seqlens[-1] - num_logits, flat.cu_seqlens[-1]))
        return flat

    def prepare(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        flat = self._flat_inputs(step)
        max_blocks = max((len(t) for t in step.block_tables), default=1)

        def tensor(x, dtype):
            return torch.tensor(x, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=tensor(flat.slots, torch.int64),
            cu_seqlens_q=tensor(flat.cu_seqlens, torch.int32),
            seq_lens=tensor(flat.seq_lens, torch.int32),
            block_tables=tensor([t + [PAD_BLOCK] * (max_blocks - len(t)) for t in step.block_tables], torch.int32),
            max_seqlen_q=max(len(t) for t in step.token_ids),
            max_seqlen_k=max(flat.seq_lens),
        )
        positions = tensor(flat.positions, torch.int64)
        if step.position_offsets is not None:
            self._apply_offsets(step, positions, meta)
        return tensor(flat.input_ids, torch.int64), positions, meta, tensor(flat.logits_indices, torch.int64)

    def _apply_offsets(self, step: StepInput, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Shift each request's positions by its device-side offset; slots and context lengths
        follow (computed on the device from the block tables). The host-side maxima stay upper bounds."""
        lengths = torch.tensor([len(t) for t in step.token_ids]).to(self.device, non_blocking=True)
        offsets = step.position_offsets
        positions += offsets.repeat_interleave(lengths, output_size=positions.numel())
        meta.seq_lens += offsets.to(meta.seq_lens.dtype)
        request_of = torch.arange(len(step.token_ids), device=self.device).repeat_interleave(
            lengths, output_size=positions.numel())
        blocks = meta.block_tables[request_of, positions // self.block_size].long()
        meta.slot_mapping = blocks * self.block_size + positions % self.block_size

    def _fill_from_device(self, input_ids: torch.Tensor, step: StepInput) -> None:
        """Put the inputs sampled last step (still on the device) in place, without a sync."""
        if not step.from_device:
            return
        dst, src = zip(*step.from_device)
        index = torch.tensor([dst, src], dtype=torch.int64).to(self.device, non_blocking=True)
        input_ids.index_copy_(0, index[0], step.device_tokens.index_select(0, index[1]))

    @torch.inference_mode()
    def run(self, step: StepInput, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [sum(num_logits), vocab] float32
        """The step's logits; on a pipeline stage before the last, its (x, residual) for the next
        stage, which passes them in as `intermediate`."""
        if self.graphs:
            logits = self._replay(step)
            if logits is not None:
                return logits
        input_ids, positions, meta, logits_indices = self.prepare(step)
        self._fill_from_device(input_ids, step)
        return self.model(input_ids, positions, self.kv_caches, self.attention, meta, logits_indices, intermediate)
