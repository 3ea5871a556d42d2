"""Engine configuration: one dataclass, validated in __post_init__."""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from backend.errors import ValidationError

DTYPES = ("float32", "bfloat16", "float16")
AUTO = "auto"  # dtype, draft_dtype, quantization; compile_decode and compile_prefill: None (EngineConfig.for_device)
SPECULATIVE_METHODS = ("none", "draft", "eagle", "ngram", "suffix")
QUANTIZATION_MODES = ("none", "int8", "int4", "fp8")  # backend/model/quantized_linear.py
INT4_GROUP_SIZES = (32, 64, 128)
MAX_BATCH_WAIT_MS = 100.0


log = logging.getLogger(__name__)


def check_quantization(mode: str, group_size: int) -> None:
    if mode not in QUANTIZATION_MODES:
        raise ValidationError("quantization", f"must be one of {QUANTIZATION_MODES}, got {mode!r}")
    if mode == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValidationError("quantization_group_size", f"must be one of {INT4_GROUP_SIZES}, got {group_size}")


@dataclass(slots=True)
class EngineConfig:
    model: str  # local HF checkpoint directory (config.json, *.safetensors, tokenizer)
    tokenizer: str | None = None  # defaults to `model`
    dtype: str = "float32"
    quantization: str = "none"  # the target's weights: "none", "int8" (per row), "int4" (per group), "fp8"
    quantization_group_size: int = 32  # int4: input columns sharing a scale and minimum (32, 64, 128)
    # CPU, int8/int4: rows of input from which a layer multiplies by a dense copy of its weight
    # (prefill, large batches); 0: timed per weight shape at load; -1: never (no copy kept)
    quantization_dense_rows: int = 0
    device: str = "auto"  # "auto": cuda if available, else cpu
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_bytes: int = 256 * 2**20  # KV pool budget on CPU (both draft and target)
    gpu_memory_utilization: float = 0.85  # fraction of total GPU memory for weights + KV on CUDA
    num_kv_blocks: int | None = None  # overrides the memory budget when set (tests)
    max_num_seqs: int = 64  # running requests at most
    max_num_batched_tokens: int = 1024  # token budget per iteration
    # an idle engine that receives a request waits while more arrive, each within this long of the last
    # (at most BATCH_WAITS times it in all, or until a step's budget waits): one step prefills a burst
    batch_wait_ms: float = 0.0
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # "auto", "torch", "cpu", "triton"
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps
    compile_decode: bool | None = False  # CPU: decode steps run compiled (torch.compile), compiled at start-up
    compile_prefill: bool | None = False  # CPU: every other step (prefill, verification, mixed) runs compiled too
    # CPU, float32 layers: multiply by copies of the weights in oneDNN's layout at the row counts
    # where that measured faster at load (as many bytes again); False: torch's matmul only
    cpu_weight_copies: bool = True
    # "none", "draft", "eagle" (a head on the target's hidden states), "ngram", "suffix" (suffix trees over
    # the request's tokens and recent outputs: backend/speculative/suffix_proposer.py)
    speculative_method: str = "none"
    draft_model: str | None = None  # directory of the draft model (method "draft") or EAGLE head ("eagle")
    draft_dtype: str | None = None  # defaults to `dtype`; on a CPU a tiny draft runs faster in float32
    num_speculative_tokens: int = 4  # max k
    adaptive_speculation: bool = True
    async_scheduling: bool | None = None  # overlap host work with the GPU; None: on CUDA without speculation
    num_threads: int = 0  # torch CPU threads for the engine; 0 keeps torch's default
    seed: int = 0
    tensor_parallel_size: int = 1  # ranks sharing each stage's layers (rank 0 is the engine; gloo on CPU)
    pipeline_parallel_size: int = 1  # stages, each a contiguous run of the target's layers
    max_batches_in_flight: int | None = None  # pipeline: batches in flight at once; None: one per stage
    pipeline_layer_partition: str = ""  # layers per stage, "5,4"; empty: as even as possible
    nnodes: int = 1  # nodes the ranks span; the others run `python -m backend.parallel.node` (torchrun's variables)
    master_port: int = 0  # nnodes > 1: the port on this node where every rank meets (MASTER_PORT)
    gpu_device_ids: str = ""  # CUDA: the first node's GPU per rank there, "2,3"; empty: from `device`'s on

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise ValidationError("model", f"not a directory: {self.model}")
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.dtype not in (*DTYPES, AUTO):
            raise ValidationError("dtype", f"must be one of {(*DTYPES, AUTO)}, got {self.dtype!r}")
        if self.quantization != AUTO:
            check_quantization(self.quantization, self.quantization_group_size)
        if self.quantization_dense_rows < -1:
            raise ValidationError("quantization_dense_rows", f"must be -1 (never), 0 (timed at load) or a row "
                                  f"count, got {self.quantization_dense_rows}")
        if self.draft_dtype is None:
            self.draft_dtype = self.dtype
        if self.draft_dtype not in (*DTYPES, AUTO):
            raise ValidationError("draft_dtype", f"must be one of {(*DTYPES, AUTO)}, got {self.draft_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValidationError("block_size", f"must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValidationError("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValidationError(
                "max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not 0.0 <= self.batch_wait_ms <= MAX_BATCH_WAIT_MS:
            raise ValidationError("batch_wait_ms", f"must be in [0, {MAX_BATCH_WAIT_MS:g}], got {self.batch_wait_ms}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValidationError(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValidationError(
                "attention_backend", f"must be auto, torch, cpu or triton, got {self.attention_backend!r}"
            )
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValidationError(
                "speculative_method",
                f"must be one of {SPECULATIVE_METHODS}, got {self.speculative_method!r}",
            )
        if self.speculative_method in ("draft", "eagle") and not self.draft_model:
            raise ValidationError("draft_model", f"required when speculative_method is {self.speculative_method!r}")
        if self.speculative_method == "eagle" and self.async_scheduling:
            raise ValidationError("async_scheduling", "must be off with an EAGLE head (it drafts from the last "
                                  "step's tokens and hidden states on the host)")
        if self.speculative_method == "eagle" and self.pipeline_parallel_size > 1:
            raise ValidationError("speculative_method", "'eagle' needs the target's hidden states on rank 0: "
                                  "pipeline_parallel_size must be 1")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValidationError("tensor_parallel_size", f"must be in [1, 64], got {self.tensor_parallel_size}")
        if not 1 <= self.pipeline_parallel_size <= 64:
            raise ValidationError("pipeline_parallel_size", f"must be in [1, 64], got {self.pipeline_parallel_size}")
        self._check_pipeline()
        for name in ("compile_decode", "compile_prefill"):
            if getattr(self, name) and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
                raise ValidationError(name, "runs on one rank: tensor_parallel_size and pipeline_parallel_size must be 1")
        if self.num_threads < 0:
            raise ValidationError("num_threads", f"must be >= 0, got {self.num_threads}")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValidationError(
                "num_speculative_tokens", f"must be in [0, 16], got {self.num_speculative_tokens}"
            )

    def _check_pipeline(self) -> None:
        pp, world = self.pipeline_parallel_size, self.tensor_parallel_size * self.pipeline_parallel_size
        if self.max_batches_in_flight is None:
            self.max_batches_in_flight = pp
        if not 1 <= self.max_batches_in_flight <= pp:
            raise ValidationError("max_batches_in_flight",
                                  f"must be in [1, pipeline_parallel_size ({pp})], got {self.max_batches_in_flight}")
        if self.pipeline_layer_partition:
            try:
                sizes = [int(n) for n in self.pipeline_layer_partition.split(",")]
            except ValueError:
                sizes = []
            if len(sizes) != pp:
                raise ValidationError("pipeline_layer_partition", f"must be {pp} comma-separated layer counts, "
                                      f"one per stage, got {self.pipeline_layer_partition!r}")
        if pp > 1 and self.async_scheduling:
            raise ValidationError("async_scheduling", "must be off with pipeline_parallel_size above 1 "
                                  "(the pipeline overlaps its batches instead)")
        if not 1 <= self.nnodes <= world or world % self.nnodes:
            raise ValidationError("nnodes", f"must divide tensor_parallel_size x pipeline_parallel_size ({world}), "
                                  f"got {self.nnodes}")
        if self.nnodes > 1 and not 0 < self.master_port < 65536:
            raise ValidationError("master_port", f"must be in [1, 65535] when nnodes is above 1, got {self.master_port}")
        if self.gpu_device_ids:
            try:
                ids = parse_gpu_ids(self.gpu_device_ids)
            except ValueError:
                raise ValidationError("gpu_device_ids", f'must be GPU ids like "0,1", got {self.gpu_device_ids!r}') from None
            if len(ids) != world // self.nnodes or len(set(ids)) != len(ids) or min(ids) < 0:
                raise ValidationError("gpu_device_ids", f"must name {world // self.nnodes} different GPUs, one per rank "
                                      f"on this node, got {self.gpu_device_ids!r}")

    def for_device(self, device_type: str) -> EngineConfig:
        """This configuration with its "auto" values chosen for a device ("cpu", "cuda"): what
        `make serve` ships is the fastest honest configuration of each. On a CPU: float32
        activations, int4 weights (the default model's own GGUF weights are Q4_1, which int4
        with groups of 32 holds exactly) and compiled decode and prefill steps where a C++
        compiler builds them (eager steps otherwise, said in the log). On a GPU: bfloat16, no
        quantization, CUDA graphs."""
        cpu = device_type == "cpu"
        dtype = ("float32" if cpu else "bfloat16") if self.dtype == AUTO else self.dtype
        chosen = dict(dtype=dtype, draft_dtype=dtype if self.draft_dtype == AUTO else self.draft_dtype)
        if self.quantization == AUTO:
            chosen["quantization"] = "int4" if cpu else "none"
        one_rank = self.tensor_parallel_size * self.pipeline_parallel_size == 1
        for name in ("compile_decode", "compile_prefill"):
            if getattr(self, name) is None:
                chosen[name] = cpu and one_rank and _cxx_compiler(name) is not None
        return replace(self, **chosen)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        return cls(**json.loads(text))

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> EngineConfig:
        """Build from string values (Triton config.pbtxt `parameters`); unknown keys are errors."""
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, raw in values.items():
            if key not in known:
                raise ValidationError(key, f"unknown engine parameter; allowed: {', '.join(known)}")
            kwargs[key] = _parse(key, str(known[key].type), raw)
        return cls(**kwargs)


def _cxx_compiler(parameter: str) -> str | None:
    """The C++ compiler torch.compile's inductor would build with ($CXX, else g++ or clang++);
    None, logged, where there is none."""
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if found is None:
        log.warning("%s=auto: no C++ compiler (set CXX or install g++), so these steps run eagerly, "
                    "several times slower", parameter)
    return found


def _parse(key: str, type_name: str, raw: str) -> Any:
    raw = raw.strip()
    if key in ("compile_decode", "compile_prefill") and raw.lower() == AUTO:
        return None
    if "None" in type_name and raw.lower() in ("", "none", "null"):
        return None
    try:
        if type_name.startswith("bool"):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if type_name.startswith("int"):
            return int(raw)
        if type_name.startswith("float"):
            return float(raw)
    except ValueError:
        raise ValidationError(key, f"cannot parse {raw!r} as {type_name}") from None
    return raw


def parse_gpu_ids(text: str) -> tuple[int, ...]:
    """ "2,3" -> (2, 3); "" -> ()."""
    return tuple(int(part) for part in text.replace(" ", "").split(",")) if text.strip() else ()
