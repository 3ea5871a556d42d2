"""Runs one model over one step's flat ragged batch, against its own paged KV pool.

The batch is flat: every scheduled token of every request, back to back, with
  input_ids[T], positions[T], slot_mapping[T]  (T = tokens this step)
  cu_seqlens_q[B+1], seq_lens[B], block_tables[B, max_blocks]  (B = requests this step)
  logits_indices[L]  rows whose logits are needed (sampling or verification).
The draft model has a runner of its own with the same block tables and its own pool.

On CUDA, a step in which every request computes the same number of tokens (one: decode; k + 1:
verification) replays a CUDA graph captured at start-up for the smallest batch-size bucket that
holds it (`graph_shape`); padding rows write nowhere (slot -1) and read cached tokens. Mixed
steps run eagerly. On a CPU, decode steps can run compiled instead (`compile_decode`,
backend/model/compiled_decode.py), and so can steps of several tokens per request (`compile_prefill`,
backend/model/compiled_extend.py).
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import torch

from backend.config import EngineConfig
from backend.errors import ValidationError
from backend.host_waits import HostWaits
from backend.model.attention import AttentionBackend, AttentionMetadata
from backend.model.compiled_decode import CompiledDecode
from backend.model.compiled_extend import CompiledExtend
from backend.model.decode_inputs import PAD_BLOCK, PAD_SLOT, DecodeInputs
from backend.model.model import LlamaForCausalLM
from backend.uploads import on_device

log = logging.getLogger(__name__)

# graph buckets: a batch runs in the smallest that holds it, padded; steps of 8, then 16, keep the
# padding (whole rows of every matmul) under 12% from 64 requests up
GRAPH_BATCH_SIZES = (1, 2, 4) + tuple(range(8, 64, 8)) + tuple(range(64, 257, 16))
# graphs of several tokens per request only up to this batch: each graph keeps its float32 logits
# ([batch x q, vocab]: 160 MB at 64 x 5 and a 128k vocabulary), and speculation pays at small
# batches (adaptive k turns it off at large ones)
MAX_MULTI_TOKEN_GRAPH_BATCH = 64


def target_graph_query_lens(config: EngineConfig, device: torch.device, attention: AttentionBackend) -> tuple[int, ...]:
    """Tokens per request of the target's CUDA graphs (every rank of a tensor-parallel stage
    captures the same ones, their all-reduces in them): 1 (decode) and, with speculation, k + 1
    (verification); () for no graphs (a CPU, enforce_eager, an attention that syncs, or a
    pipeline, whose stages run a step's layers apart)."""
    if device.type != "cuda" or config.enforce_eager or not attention.supports_cuda_graphs \
            or config.pipeline_parallel_size > 1:
        return ()
    return (1,) if config.speculative_method == "none" else (1, config.num_speculative_tokens + 1)


def graph_shape(step: StepInput, sizes: dict[int, tuple[int, ...]]) -> tuple[int, int] | None:
    """The (batch bucket, tokens per request) of the graph that can replay `step`, or None. It
    fits when every request computes the same number q of tokens, a q graphs were captured for (1: a
    decode step; k + 1: a verification of k drafts each; 2: a draft's first forward after one),
    every request wants the logits of all q or of its last token only, and the batch fits one of
    the buckets captured for q (`sizes`: q -> batch buckets). Offsets known only on the device
    (overlapped steps) do not matter: the graph applies them."""
    if not step.token_ids:
        return None
    q, m = len(step.token_ids[0]), step.num_logits[0]
    if q not in sizes or any(len(t) != q for t in step.token_ids):
        return None
    if m not in (1, q) or any(n != m for n in step.num_logits):
        return None
    b = len(step.token_ids)
    fitting = [size for size in sizes[q] if size >= b]
    return (min(fitting), q) if fitting else None


def is_host_decode(step: StepInput) -> bool:
    """Every request computes one token, read from the host, at the position the host knows."""
    return (not step.from_device and step.position_offsets is None
            and all(len(t) == 1 for t in step.token_ids) and all(n == 1 for n in step.num_logits))


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
    # K/V rows to copy before the forward, as (source block, destination block, tokens): the
    # shared head of a cached block going into a request's own block (BlockManager.take_copies)
    block_copies: list[tuple[int, int, int]] = field(default_factory=list)

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
        waits: HostWaits | None = None,
    ):
        self.model = model
        self.waits = waits if waits is not None else HostWaits()  # the engine's, shared by its runners
        self.attention = attention
        self.device = device
        self.block_size = block_size
        a = model.args
        shape = (num_blocks, block_size, a.num_kv_heads, a.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(a.num_layers)
        ]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (batch bucket, tokens per request) -> graph
        self.graph_io: dict[str, torch.Tensor] = {}  # static inputs and outputs shared by all graphs
        self.graph_sizes: dict[int, tuple[int, ...]] = {}  # tokens per request -> batch buckets captured
        self.graph_max_seqlen_k = 0
        self.graph_replays = 0
        self.decode_inputs: DecodeInputs | None = None  # host staging of the graphs' inputs
        self.compiled_decode: CompiledDecode | None = None  # a CPU's compiled decode steps, when asked for
        self.compiled_extend: CompiledExtend | None = None  # and its other steps compiled, when asked for
        self.launched: collections.deque[torch.Tensor] = collections.deque()  # logits not collected yet

    def init_decode_inputs(self, max_batch_size: int, max_blocks: int, max_tokens_per_row: int = 1) -> None:
        self.decode_inputs = DecodeInputs(max_batch_size, max_blocks, pin=self.device.type == "cuda", waits=self.waits,
                                          max_tokens_per_row=max_tokens_per_row)

    def init_graph_io(self, max_batch_size: int, max_model_len: int, query_lens: tuple[int, ...] = (1,)) -> None:
        """The static inputs every graph reads (and their host staging), for batches up to
        `max_batch_size` in GRAPH_BATCH_SIZES buckets and `query_lens` tokens per request. Made
        on any device: on a CPU `graph_forward_static` runs what a graph would replay."""
        batch_sizes = tuple(b for b in GRAPH_BATCH_SIZES if b < max_batch_size) + (max_batch_size,)
        self.graph_sizes = {q: batch_sizes if q == 1 else tuple(b for b in batch_sizes if b <= MAX_MULTI_TOKEN_GRAPH_BATCH)
                            for q in sorted(set(query_lens))}
        biggest, max_q = max(batch_sizes), max(self.graph_sizes)
        self.graph_max_seqlen_k = max_model_len
        max_blocks = (max_model_len + self.block_size - 1) // self.block_size
        dev = self.device
        self.graph_io = dict(
            input_ids=torch.zeros(biggest * max_q, dtype=torch.int64, device=dev),
            positions=torch.zeros(biggest * max_q, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((biggest * max_q,), PAD_SLOT, dtype=torch.int64, device=dev),
            seq_lens=torch.full((biggest,), max_q, dtype=torch.int32, device=dev),  # >= q: warm-up reads cached tokens
            block_tables=torch.full((biggest, max_blocks), PAD_BLOCK, dtype=torch.int32, device=dev),
            position_offsets=torch.zeros(biggest, dtype=torch.int64, device=dev),
            logits_indices=torch.arange(biggest * max_q, dtype=torch.int64, device=dev),
        )
        for q in self.graph_sizes:
            self.graph_io[f"cu_seqlens_q_{q}"] = torch.arange(0, (biggest + 1) * q, q, dtype=torch.int32, device=dev)
            self.graph_io[f"token_rows_{q}"] = torch.arange(biggest, device=dev).repeat_interleave(q)
        self.init_decode_inputs(biggest, max_blocks, max_q)

    def compile_decode(self) -> None:
        """Run decode steps compiled from now on (a CPU; compiles at once). A machine where
        torch.compile cannot build (no C++ compiler) fails the load, naming the parameter."""
        self.compiled_decode = self._warm_up(CompiledDecode(self.model, self.kv_caches), "compile_decode",
                                             "the decode step")

    def compile_prefill(self) -> None:
        """Run steps of several tokens per request compiled from now on (a CPU; compiles at once),
        failing the load as `compile_decode` does."""
        self.compiled_extend = self._warm_up(CompiledExtend(self.model, self.kv_caches), "compile_prefill",
                                             "the prefill step")

    def _warm_up(self, compiled: CompiledDecode | CompiledExtend, parameter: str, what: str):
        """Compile now; inductor's disk cache keeps the result for the next start of the same model."""
        from torch._inductor.runtime.cache_dir_utils import cache_dir  # (inductor's import takes seconds)

        log.info("%s: compiling %s (a few minutes on a first start; later starts read the compile cache in %s)",
                 parameter, what, cache_dir())
        start = time.perf_counter()
        try:
            compiled.warm_up(self.block_size)
        except Exception as e:  # inductor's errors have no common base
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValidationError(parameter, f"torch.compile could not build {what} ({reason}); "
                                  f"set {parameter} to false, or install a C++ compiler") from e
        log.info("%s: %s compiled in %.0f s", parameter, what, time.perf_counter() - start)
        return compiled

    @torch.inference_mode()
    def capture_graphs(self, max_batch_size: int, max_model_len: int, query_lens: tuple[int, ...] = (1,)) -> None:
        """Capture one graph per batch-size bucket and tokens per request (CUDA only)."""
        self.init_graph_io(max_batch_size, max_model_len, query_lens)
        pool = None
        for q, batch_sizes in self.graph_sizes.items():
            for b in sorted(batch_sizes, reverse=True):  # biggest first: smaller graphs reuse its pool
                self.graphs[(b, q)], self.graph_io[f"logits_{b}_{q}"], pool = self.capture_graph(b, q, pool)

    def capture_graph(self, b: int, q: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, object]:
        """The graph of `b` rows of `q` tokens, the logits it writes, and its memory pool."""
        self.graph_forward_static(b, q)  # warm-up: compiles kernels outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.graph_forward_static(b, q)
        torch.cuda.synchronize(self.device)
        return graph, logits, graph.pool()

    def graph_forward_static(self, b: int, q: int) -> torch.Tensor:  # [b * q, vocab] float32
        """The forward a graph of `b` rows and `q` tokens each replays, from the static inputs
        alone. Positions, context lengths and slots are corrected on the device by each row's
        position offset (overlapped speculation: how many of the last step's drafts were rejected;
        zero otherwise), so such steps replay a graph too."""
        io, bs, n = self.graph_io, self.block_size, b * q
        offsets = io["position_offsets"][:b]
        positions = io["positions"][:n] + offsets.repeat_interleave(q, output_size=n)
        block_tables = io["block_tables"][:b]
        blocks = block_tables[io[f"token_rows_{q}"][:n], positions // bs].long()
        host_slots = io["slot_mapping"][:n]  # PAD_SLOT marks the padding rows' tokens: they write nowhere
        slots = torch.where(host_slots == PAD_SLOT, host_slots, blocks * bs + positions % bs)
        meta = AttentionMetadata(slots, io[f"cu_seqlens_q_{q}"][: b + 1], io["seq_lens"][:b] + offsets.int(),
                                 block_tables, max_seqlen_q=q, max_seqlen_k=self.graph_max_seqlen_k)
        return self.model(io["input_ids"][:n], positions, self.kv_caches, self.attention, meta,
                          io["logits_indices"][:n])

    def stage_graph_inputs(self, step: StepInput) -> tuple[int, int] | None:
        """Put a step that fits a graph into the static inputs; its (bucket, q), or None."""
        shape = graph_shape(step, self.graph_sizes)
        if shape is None:
            return None
        bucket, q = shape
        b = len(step.token_ids)
        self.decode_inputs.upload(self.graph_inputs(step, bucket, q), self.graph_io)
        offsets = self.graph_io["position_offsets"]
        offsets[:bucket].zero_()
        if step.position_offsets is not None:  # on the device already: no wait
            offsets[:b].copy_(step.position_offsets)
        self._fill_from_device(self.graph_io["input_ids"], step)
        return shape

    def _replay(self, step: StepInput) -> torch.Tensor | None:
        """Run a step through a captured graph; None when no graph fits it."""
        shape = self.stage_graph_inputs(step)
        if shape is None or shape not in self.graphs:
            return None
        self.graphs[shape].replay()
        self.graph_replays += 1
        bucket, q = shape
        return self.step_logits(self.graph_io[f"logits_{bucket}_{q}"], step)

    @staticmethod
    def step_logits(graph_logits: torch.Tensor, step: StepInput) -> torch.Tensor:
        """The logits the step asked for, of a graph's (every token's, [bucket * q, vocab])."""
        b, q, m = len(step.token_ids), len(step.token_ids[0]), step.num_logits[0]
        logits = graph_logits[: b * q]
        return logits if m == q else logits.view(b, q, -1)[:, q - m :].reshape(b * m, -1)

    def graph_inputs(self, step: StepInput, bucket: int, q: int = 1) -> dict[str, torch.Tensor]:
        """Host tensors for a graph of `bucket` rows of `q` tokens (after `init_decode_inputs`):
        the step's flat inputs, then padding rows that write nowhere and read q cached tokens."""
        flat = self._flat_inputs(step)
        return self.decode_inputs.fill(flat.input_ids, flat.positions, flat.slots, flat.seq_lens,
                                       step.block_tables, bucket, q)

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
            return on_device(x, self.device, dtype)

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
        lengths = on_device([len(t) for t in step.token_ids], self.device, torch.int64)
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
        index = on_device([dst, src], self.device, torch.int64)
        input_ids.index_copy_(0, index[0], step.device_tokens.index_select(0, index[1]))

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Each (source, destination, n): the first n token rows of the source block's K and V
        into the destination's, in every layer, and their features where an EAGLE head reads
        them by KV slot (queued ahead of the step's forward)."""
        features, bs = getattr(self.model, "feature_pool", None), self.block_size
        for source, destination, n in copies:
            for k_cache, v_cache in self.kv_caches:
                k_cache[destination, :n] = k_cache[source, :n]
                v_cache[destination, :n] = v_cache[source, :n]
            if features is not None:
                features[destination * bs : destination * bs + n] = features[source * bs : source * bs + n]

    def launch(self, step: StepInput) -> None:
        """Start a step (its kernels queue on the device); `collect` returns its logits. The
        engine drives every runner so, one stage or a pipeline of them."""
        self.launched.append(self.run(step))

    def collect(self) -> torch.Tensor:  # [sum(num_logits), vocab] float32
        """The logits of the oldest step launched and not collected."""
        return self.launched.popleft()

    @torch.inference_mode()
    def run(self, step: StepInput, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [sum(num_logits), vocab] float32
        """The step's logits; on a pipeline stage before the last, its (x, residual) for the next
        stage, which passes them in as `intermediate`."""
        self.copy_blocks(step.block_copies)
        if self.graphs:
            logits = self._replay(step)
            if logits is not None:
                return logits
        input_ids, positions, meta, logits_indices = self.prepare(step)
        compiled = intermediate is None and (self.compiled_decode is not None or self.compiled_extend is not None)
        decode = compiled and is_host_decode(step)  # (asked only where a compiled path may take the step)
        if decode and self.compiled_decode is not None:
            if self.compiled_decode.takes(len(step.token_ids)):
                return self.compiled_decode.run(input_ids, positions, meta, logits_indices)
            self.compiled_decode.dense_steps += 1
        self._fill_from_device(input_ids, step)
        if compiled and not decode and self.compiled_extend is not None \
                and self.compiled_extend.takes(input_ids.shape[0], logits_indices.shape[0]):
            return self.compiled_extend.run(input_ids, positions, meta, logits_indices)
        return self.model(input_ids, positions, self.kv_caches, self.attention, meta, logits_indices, intermediate)
