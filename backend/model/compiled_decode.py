"""Decode steps as compiled graphs on a CPU: the model's own forward through torch.compile (inductor).

A CPU has no CUDA graphs, and at a small batch a decode step of a small model is mostly small
torch operations: the default model's runs some 2,000 of them (norms, RoPE, casts, attention
glue), each a few microseconds of dispatch around little arithmetic. Compiled, their chains
become fused C++ loops and the dispatch goes; the matmuls (float, or the packed weight-only
kernels) stay the same calls.

Only decode steps take this path (every request computes one token, read from the host, with no
position correction); prefill, chunked prefill and verification run eagerly. The forward is traced
with two dynamic sizes, the requests and the pages each reads, into two graphs, one request and
several (torch specializes a size of 1), both compiled at start-up so that no request waits for
the compiler; inductor keeps the compiled code on disk, so the next start is shorter. Where
quantized layers keep dense copies for many rows (quantization_dense_rows), int4 layers choose
them inside the graphs by row count (backend/model/quantized_linear.py, `int4_product`); int8 ones
keep their packed kernels there, and decode steps from the number of requests at which the eager
step measured faster at start-up run eagerly, through the copies. A step's block tables are padded to
at least two pages (the padding masked), so that a short context never meets a size of 1. The
warm-up's sizes are all different numbers: torch would take two sizes that are equal at tracing to
be equal always.

`DecodeAttention` is TorchAttention's decode step written to trace as one graph: no host reads
(the KV store's padding check, the plan made on the first layer) and no per-step state on self.
Where the CPU attention kernel applies (kernels/specserve_kernels/paged_attention_cpu.py: float32) attention is that
kernel as a torch operator, reading the block tables itself, and the step needs no plan.
"""
from __future__ import annotations

import locale
import logging

import torch

from backend.model.attention import AttentionBackend, AttentionMetadata
from backend.model.linear_tuner import rows_for_dense, time_call
from backend.model.model import LlamaForCausalLM
from backend.model.quantized_linear import WeightOnlyLinear
from specserve_kernels import paged_attention_cpu
from specserve_kernels.paged_attention import _attend_decode, plan_reference
from specserve_kernels.paged_attention_cpu import paged_attention_op
from specserve_kernels.rotary import rotary_tables, rotate

TIMED_BATCHES = (4, 8, 16, 32, 64)  # decode steps timed compiled and eager at start-up (quantized)
MIN_PAGES = 2  # block tables are padded to this many pages: a size of 1 would be a graph of its own
GRAPHS = 2  # one request, several

log = logging.getLogger(__name__)


class DecodeAttention(AttentionBackend):
    """A decode step's RoPE, KV store and paged attention as pure tensor operations, for tracing:
    every slot is a real one (decode steps have no padding rows). Attention is the CPU kernel's
    operator where `kernel`, else the reference's decode path on a plan made before the forward
    (`meta.reference_plan`, a decode plan)."""

    name = "torch-decode"

    def __init__(self, kernel: bool = False) -> None:
        self.kernel = kernel

    def rotate_and_store(self, q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
        tables = rotary_tables(positions, cos, sin)  # the same in every layer: a few fused ops each
        q, k = rotate(q, tables), rotate(k, tables)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return q

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.kernel:
            return paged_attention_op(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale)
        return _attend_decode(q, k_cache, v_cache, meta.reference_plan.short, scale)


def run_compiled(compiled, args: tuple, what: str) -> torch.Tensor:
    """compiled.forward(*args) in a graph compiled at start-up, counted in compiled.steps; where
    none fits (a bug), compiled.model(*args) eagerly rather than stall every request for a
    compile, counted in compiled.eager_steps (and logged the first time)."""
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            logits = compiled.forward(*args)
    except RuntimeError as e:
        if "Detected recompile" not in str(e):  # torch's message for this stance (no error class of its own)
            raise
        if not compiled.eager_steps:
            log.warning("%s fits no compiled graph; running it eagerly: %s", what, str(e).splitlines()[0])
        compiled.eager_steps += 1
        return compiled.model(*args)
    compiled.steps += 1
    return logits


def read_text_as_utf8() -> None:
    """inductor reads its code templates with open()'s default encoding, the locale's; in a
    process started without a locale (Triton's python backend stub) that is ASCII, and compiling
    fails on the first non-ASCII byte. Files are read as UTF-8 from then on."""
    if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")


class CompiledDecode:
    """The model's forward compiled for decode steps; `run` takes a step's prepared inputs."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        read_text_as_utf8()
        self.model, self.kv_caches = model, kv_caches
        a, k_cache = model.args, kv_caches[0][0]
        q = k_cache.new_empty(0, a.num_heads, a.head_dim, dtype=model.model.norm.weight.dtype)  # (its dtype and heads)
        self.attention = DecodeAttention(kernel=paged_attention_cpu.supports(q, k_cache))
        self.forward = torch.compile(model.forward, fullgraph=True)  # sizes marked dynamic in warm_up
        # torch keeps at most recompile_limit graphs of one code object, and every model in the
        # process shares its forward's code (a target and its draft, engines made one after another):
        # each compiled model makes room for its own graphs (run's stance refuses any other compile)
        torch._dynamo.config.recompile_limit += GRAPHS
        self.steps = 0  # decode steps run compiled
        self.eager_steps = 0  # decode steps that would have compiled a new graph, run eagerly instead
        self.dense_steps = 0  # decode steps of max_requests or more, run eagerly (the runner counts)
        # the graphs keep the packed weight-only kernels; where quantized layers keep dense copies
        # (set at load, before this) warm_up times from how many requests the eager step is faster
        self.max_requests: int | None = None  # decode steps of this many requests or more run eagerly
        self.timings: dict[int, tuple[float, float]] = {}  # requests -> (compiled, eager) seconds

    def takes(self, num_requests: int) -> bool:
        """Whether a decode step of this many requests runs compiled."""
        return self.max_requests is None or num_requests < self.max_requests

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_indices: torch.Tensor) -> torch.Tensor:  # [num_requests, vocab] float32
        """One decode step (one token per request). A step that fits neither graph (a bug) runs
        eagerly rather than stall every request for a compile."""
        self._plan(meta)
        return run_compiled(self, (input_ids, positions, self.kv_caches, self.attention, meta, logits_indices),
                            "a decode step")

    def _plan(self, meta: AttentionMetadata) -> None:
        """The step's block tables padded to MIN_PAGES (block 0, masked or never read), and its
        decode plan where the reference attends."""
        tables = meta.block_tables
        if tables.shape[1] < MIN_PAGES:
            meta.block_tables = torch.cat([tables, tables.new_zeros(tables.shape[0], MIN_PAGES - tables.shape[1])], 1)
        if self.attention.kernel:
            return
        k_cache = self.kv_caches[0][0]
        meta.reference_plan = plan_reference(meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                             k_cache.shape[1], k_cache.shape[0], min_pages=MIN_PAGES)

    def _inputs(self, num_requests: int, pages: int, block_size: int):
        """Throw-away decode inputs: num_requests requests each reading `pages` pages, whose K/V go
        to slots 0 to num_requests - 1, which no request holds yet (this runs before the first)."""
        rows = torch.arange(num_requests)
        length = (pages - 1) * block_size + 1
        meta = AttentionMetadata(
            slot_mapping=rows.clone(), cu_seqlens_q=torch.arange(num_requests + 1, dtype=torch.int32),
            seq_lens=torch.full((num_requests,), length, dtype=torch.int32),
            block_tables=torch.zeros(num_requests, pages, dtype=torch.int32),
            max_seqlen_q=1, max_seqlen_k=length)
        self._plan(meta)
        return rows, torch.full((num_requests,), length - 1), meta, rows.clone()

    @torch.inference_mode()
    def warm_up(self, block_size: int) -> None:
        """Compile both graphs now, on throw-away inputs (one request reading 3 pages, then 2
        requests reading 4: no two dynamic sizes equal); then, where quantized layers keep dense
        copies, time the compiled step against the eager one (`_time_against_eager`)."""
        # The graphs' guards check each module's dictionary version first and skip the guards below
        # it where that is unchanged: the default model's guards over its 495 tensors took 1.3 ms
        # of a 12 ms step, and take 0.6 ms so. A module that gains or loses an attribute still
        # fails them (a test adds one).
        with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True):
            for num_requests, pages in ((1, 3), (2, 4)):
                rows, positions, meta, logits_indices = self._inputs(num_requests, pages, block_size)
                if self.attention.kernel:
                    # what the forward reads: [R] ids, positions, slots, logits rows, context lengths;
                    # [R + 1] query offsets; [R, pages] tables
                    dynamic = [(meta.block_tables, 1)]
                    if num_requests > 1:
                        dynamic += [(t, 0) for t in (rows, positions, meta.slot_mapping, logits_indices, meta.seq_lens,
                                                     meta.cu_seqlens_q, meta.block_tables)]
                else:
                    short = meta.reference_plan.short
                    # what the forward reads: [R] ids, positions, slots, logits rows; the plan's [R, pages]
                    # tables, [R, 1, pages x block_size] mask and [R x pages] page ids
                    dynamic = [(short.block_tables, 1), (short.mask, 2), (short.page_ids, 0)]
                    if num_requests > 1:
                        dynamic += [(t, 0) for t in (rows, positions, meta.slot_mapping, logits_indices,
                                                     short.block_tables, short.mask)]
                for tensor, dim in dynamic:
                    torch._dynamo.mark_dynamic(tensor, dim)
                self.forward(rows, positions, self.kv_caches, self.attention, meta, logits_indices)
        self._time_against_eager(block_size)

    def _time_against_eager(self, block_size: int) -> None:
        """Sets max_requests to the fewest requests of TIMED_BATCHES from which the eager step
        (through the dense copies) was faster than the compiled one (packed kernels) at every count
        timed (None: at none). A layer's own threshold is no guide: the eager step also pays for
        the small operations the graph fuses (measured on the default model at 2 threads, served:
        8 streams 226 tok/s compiled, 170 eager; 32 streams 289 compiled, 383 eager)."""
        if not any(isinstance(m, WeightOnlyLinear) and m.dense_weight is not None for m in self.model.modules()):
            return
        slots = self.kv_caches[0][0].shape[0] * block_size
        self.timings = {}
        for num_requests in TIMED_BATCHES:
            if num_requests > slots:
                break
            rows, positions, meta, logits_indices = self._inputs(num_requests, 4, block_size)
            compiled = time_call(lambda: self.forward(rows, positions, self.kv_caches, self.attention, meta,
                                                      logits_indices), None, 3)
            eager = time_call(lambda: self.model(rows, positions, self.kv_caches, self.attention, meta,
                                                 logits_indices), None, 3)
            self.timings[num_requests] = (compiled, eager)
        self.max_requests = rows_for_dense(self.timings)
