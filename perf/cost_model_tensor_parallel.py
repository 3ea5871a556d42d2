"""A cost model, on paper, of tensor-parallel decode: ms/token and tokens/s for Llama-3-8B and
Llama-3-70B shapes on NVIDIA H200 GPUs at TP 1, 2, 4 and 8. Pure arithmetic, no GPU.

    python -m perf.cost_model_tensor_parallel                          # the tables, in markdown
    python -m perf.cost_model_tensor_parallel --hbm-efficiency 0.75 --context 4096 --batch 128

Assumptions (the ones with a default are command-line options):
- Shapes. Llama-3-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads of 128, MLP 14336, vocab
  128256, untied lm_head. Llama-3-70B: hidden 8192, 80 layers, 64 heads, 8 KV heads of 128,
  MLP 28672, vocab 128256. Weights, KV cache and communicated activations are bf16 (2 bytes).
- Sharding (Megatron style): q/k/v/gate/up split by columns, o_proj/down_proj by rows, the
  embedding and lm_head vocab-parallel (1/TP each), RMSNorm weights replicated. K/V heads are
  split and replicate when TP > KV heads: KV heads per rank = max(1, KV heads / TP).
- Bytes read per decode step per rank: each weight matrix of the rank once (the embedding lookup
  reads B rows: neglected) plus the KV cache, B * L * layers * 2 * kv_heads_per_rank * head_dim
  * 2 bytes, where L is the number of tokens cached per sequence.
- FLOPs per step per rank: 2 * matmul weights * B, plus attention, 4 * heads_per_rank * head_dim
  * L per layer per sequence (QK^T and PV).
- H200: 4.8 TB/s HBM3e peak times an achieved fraction (--hbm-efficiency, default 0.85); 989
  TFLOP/s dense BF16 peak times an achieved fraction (--flops-efficiency, default 0.7); 139 GiB per
  GPU for weights + KV cache (--usable-gib; nvidia-smi shows 143,771 MiB = 140.4 GiB). Activations,
  CUDA graphs and NCCL buffers are not counted: lower --usable-gib to leave room for them.
- Step time = max(bytes / bandwidth, FLOPs / compute) + communication time: communication does
  not overlap compute; host overhead, launch gaps and sampling are not modelled.
- Communication per step: 2 all-reduces per layer (after o_proj and down_proj) and one after the
  vocab-parallel embedding, each of B * hidden * 2 bytes, and the logits gathered to rank 0,
  B * vocab * 2 bytes (an all-gather moves as many bytes per GPU). A ring all-reduce moves
  2(N-1)/N * bytes through each GPU, a gather (N-1)/N * bytes. NVLink 4 gives 900 GB/s per GPU
  counting both directions, 450 GB/s per direction; times --nvlink-efficiency (default 0.8) that
  is the bus bandwidth, 360 GB/s. Each collective also pays a fixed latency
  (--allreduce-latency-us, default 8 us, the order of an NCCL or custom all-reduce of a few KB
  inside one NVSwitch node).
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
from dataclasses import dataclass, replace

GIB = 1024**3
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_tb_s: float      # peak HBM bandwidth
    nvlink_gb_s: float   # per GPU, both directions together
    bf16_tflops: float   # dense peak


@dataclass(frozen=True)
class Assumptions:
    hbm_efficiency: float
    flops_efficiency: float
    nvlink_efficiency: float
    allreduce_latency_us: float
    usable_gib: float
    weight_bytes: float = 2.0  # bf16; the KV cache and activations are bf16 too


@dataclass(frozen=True)
class StepTime:
    memory_s: float
    compute_s: float
    comm_s: float

    @property
    def total_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.comm_s


LLAMA3_8B = ModelShape("Llama-3-8B", 4096, 32, 32, 8, 128, 14336, 128256)
LLAMA3_70B = ModelShape("Llama-3-70B", 8192, 80, 64, 8, 128, 28672, 128256)
H200 = Gpu("H200 SXM", 4.8, 900.0, 989.0)
H100 = Gpu("H100 80G (SXM assumed)", 3.35, 900.0, 989.0)  # only for the published H100 figures


def kv_heads_per_rank(m: ModelShape, tp: int) -> int:
    return max(1, m.kv_heads // tp)


def matmul_params_per_rank(m: ModelShape, tp: int) -> float:
    """Weights of the rank's q/k/v/o, MLP and lm_head shards: everything a GEMM reads."""
    q_and_o = 2 * (m.heads // tp) * m.head_dim * m.hidden
    k_and_v = 2 * kv_heads_per_rank(m, tp) * m.head_dim * m.hidden
    mlp = 3 * m.hidden * m.intermediate / tp
    return m.layers * (q_and_o + k_and_v + mlp) + m.vocab * m.hidden / tp


def read_weight_bytes_per_rank(m: ModelShape, tp: int, a: Assumptions) -> float:
    norms = (2 * m.layers + 1) * m.hidden
    return (matmul_params_per_rank(m, tp) + norms) * a.weight_bytes


def stored_weight_bytes_per_rank(m: ModelShape, tp: int, a: Assumptions) -> float:
    return read_weight_bytes_per_rank(m, tp, a) + m.vocab * m.hidden / tp * a.weight_bytes


def kv_bytes_per_token_per_rank(m: ModelShape, tp: int) -> float:
    return m.layers * 2 * kv_heads_per_rank(m, tp) * m.head_dim * 2


def step_flops_per_rank(m: ModelShape, tp: int, batch: int, context: int) -> float:
    attention = 4 * (m.heads // tp) * m.head_dim * context * m.layers
    return batch * (2 * matmul_params_per_rank(m, tp) + attention)


def hbm_bytes_per_s(gpu: Gpu, a: Assumptions) -> float:
    return gpu.hbm_tb_s * 1e12 * a.hbm_efficiency


def flops_per_s(gpu: Gpu, a: Assumptions) -> float:
    return gpu.bf16_tflops * 1e12 * a.flops_efficiency


def bus_bytes_per_s(gpu: Gpu, a: Assumptions) -> float:
    return gpu.nvlink_gb_s / 2 * 1e9 * a.nvlink_efficiency  # one direction


def collective_s(traffic_bytes: float, gpu: Gpu, a: Assumptions) -> float:
    return a.allreduce_latency_us * 1e-6 + traffic_bytes / bus_bytes_per_s(gpu, a)


def comm_s(m: ModelShape, tp: int, batch: int, gpu: Gpu, a: Assumptions) -> float:
    if tp == 1:
        return 0.0
    allreduce = collective_s(2 * (tp - 1) / tp * batch * m.hidden * 2, gpu, a)
    logits_gather = collective_s((tp - 1) / tp * batch * m.vocab * 2, gpu, a)
    return (2 * m.layers + 1) * allreduce + logits_gather


def step_time(m: ModelShape, tp: int, batch: int, context: int, gpu: Gpu, a: Assumptions) -> StepTime:
    nbytes = read_weight_bytes_per_rank(m, tp, a) + batch * context * kv_bytes_per_token_per_rank(m, tp)
    return StepTime(nbytes / hbm_bytes_per_s(gpu, a),
                    step_flops_per_rank(m, tp, batch, context) / flops_per_s(gpu, a),
                    comm_s(m, tp, batch, gpu, a))


def kv_room_gib(m: ModelShape, tp: int, a: Assumptions) -> float:
    return a.usable_gib - stored_weight_bytes_per_rank(m, tp, a) / GIB


def max_batch(m: ModelShape, tp: int, context: int, a: Assumptions) -> int:
    room_bytes = max(0.0, kv_room_gib(m, tp, a)) * GIB
    return int(room_bytes // (context * kv_bytes_per_token_per_rank(m, tp)))


def compute_bound_batch(m: ModelShape, tp: int, context: int, gpu: Gpu, a: Assumptions) -> int | None:
    """The smallest batch whose FLOPs take longer than its HBM reads; None when no batch does
    (each added sequence then costs more time in KV reads than in FLOPs)."""
    weights_s = read_weight_bytes_per_rank(m, tp, a) / hbm_bytes_per_s(gpu, a)
    kv_s_per_seq = context * kv_bytes_per_token_per_rank(m, tp) / hbm_bytes_per_s(gpu, a)
    flops_s_per_seq = step_flops_per_rank(m, tp, 1, context) / flops_per_s(gpu, a)
    if flops_s_per_seq <= kv_s_per_seq:
        return None
    return math.ceil(weights_s / (flops_s_per_seq - kv_s_per_seq))


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def batch1_table(m: ModelShape, args: argparse.Namespace, a: Assumptions) -> list[str]:
    short, long = args.context, args.long_context
    lines = [f"Batch 1. Max batch: sequences of {short} cached tokens that fit in the KV room.", "",
             f"| TP | weights GiB/GPU | KV room GiB/GPU | max batch @ {short} | ms/token @ {short} "
             f"| ms/token @ {long} | all-reduce share @ {short} | tok/s per request @ {short} |",
             "|---|---|---|---|---|---|---|---|"]
    for tp in TP_SIZES:
        weights_gib, room = stored_weight_bytes_per_rank(m, tp, a) / GIB, kv_room_gib(m, tp, a)
        if room <= 0:
            lines.append(f"| {tp} | {weights_gib:.1f} | does not fit | - | - | - | - | - |")
            continue
        t, t_long = step_time(m, tp, 1, short, H200, a), step_time(m, tp, 1, long, H200, a)
        lines.append(f"| {tp} | {weights_gib:.1f} | {room:.1f} | {max_batch(m, tp, short, a)} | {ms(t.total_s)} "
                     f"| {ms(t_long.total_s)} | {t.comm_s / t.total_s:.0%} | {1 / t.total_s:.0f} |")
    return lines


def batched_table(m: ModelShape, args: argparse.Namespace, a: Assumptions) -> list[str]:
    batch, context = args.batch, args.context
    lines = [f"Batch {batch}, {context} tokens cached per sequence. Step = max(HBM, compute) + comm.", "",
             "| TP | KV fits | HBM ms | compute ms | comm ms | step ms | aggregate tok/s | tok/s per request "
             "| compute-bound from batch |",
             "|---|---|---|---|---|---|---|---|---|"]
    for tp in TP_SIZES:
        if kv_room_gib(m, tp, a) <= 0:
            lines.append(f"| {tp} | weights do not fit | - | - | - | - | - | - | - |")
            continue
        t, room = step_time(m, tp, batch, context, H200, a), max_batch(m, tp, context, a)
        rates = f"{batch / t.total_s:,.0f} | {1 / t.total_s:.0f}" if room >= batch else "- | -"
        crossover = compute_bound_batch(m, tp, context, H200, a) or "never (KV-bound)"
        lines.append(f"| {tp} | {'yes' if room >= batch else f'no (max {room})'} | {ms(t.memory_s)} "
                     f"| {ms(t.compute_s)} | {ms(t.comm_s)} | {ms(t.total_s)} | {rates} | {crossover} |")
    return lines


@dataclass(frozen=True)
class Published:
    label: str
    url: str
    gpu: Gpu
    model: ModelShape
    tp: int
    weight_bytes: float
    batch: int
    input_len: int
    output_len: int
    reported: str           # the figure as published
    ms_per_step: float      # the same figure as ms per decode step


VLLM_NIGHTLY = "https://buildkite.com/vllm/performance-benchmark/builds/9515"
NIM_PERF = "https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance"
PUBLISHED = [
    # vLLM nightly latency tests (vllm-project/vllm .buildkite/nightly-benchmarks/tests/latency-tests.json):
    # batch 8, 32 in / 128 out, dtype auto (bf16 checkpoints), dummy weights; mean end-to-end latency of the
    # batch. / 128 steps = ms per step, the prefill of 8 x 32 tokens included.
    Published("vLLM nightly, Llama-3(.1)-8B, bf16", VLLM_NIGHTLY, H200, LLAMA3_8B, 1, 2, 8, 32, 128,
              "833.4 ms end to end", 833.421 / 128),
    Published("vLLM nightly, Llama-3-70B-Instruct, bf16", VLLM_NIGHTLY, H200, LLAMA3_70B, 4, 2, 8, 32, 128,
              "2077.5 ms end to end", 2077.53 / 128),
    # NVIDIA NIM 1.8.0, Llama-3.3-70B-Instruct (Llama-3-70B shapes), 2 x H100 80G, fp8 TP2, concurrency 1.
    Published("NIM 1.8.0, Llama-3.3-70B-Instruct, fp8", NIM_PERF, H100, LLAMA3_70B, 2, 1, 1, 500, 2000,
              "ITL 18.91 ms", 18.91),
    Published("NIM 1.8.0, Llama-3.3-70B-Instruct, fp8", NIM_PERF, H100, LLAMA3_70B, 2, 1, 1, 5000, 500,
              "ITL 18.58 ms", 18.58),
]


def predicted_ms(p: Published, a: Assumptions) -> float:
    """The model under the figure's own conditions, at the mean context over its decode steps."""
    conditions = replace(a, weight_bytes=p.weight_bytes)
    return step_time(p.model, p.tp, p.batch, p.input_len + p.output_len // 2, p.gpu, conditions).total_s * 1e3


def published_table(a: Assumptions) -> list[str]:
    lines = ["| source | GPU | TP | batch | in / out | published | ms/step | model ms/step | published / model |",
             "|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for p in PUBLISHED:
        model = predicted_ms(p, a)
        ratios.append(p.ms_per_step / model)
        lines.append(f"| [{p.label}]({p.url}) | {p.gpu.name} | {p.tp} | {p.batch} | {p.input_len} / {p.output_len} "
                     f"| {p.reported} | {p.ms_per_step:.2f} | {model:.2f} | {ratios[-1]:.2f}x |")
    return lines + [
        "", f"Published steps are {min(ratios):.2f}x to {max(ratios):.2f}x the model's. The model is a floor: no "
        "host overhead or launch gaps, and attention and small GEMMs read HBM as efficiently as large ones; the "
        "vLLM figures also include the prefill of 8 x 32 tokens. Each row evaluates the model under the figure's "
        "own GPU, TP, batch, weight precision and mean context (KV cache in bf16)."]


def add_assumption_arguments(ap: argparse.ArgumentParser) -> None:
    """The options behind Assumptions (assumptions_from(args) reads them back)."""
    ap.add_argument("--hbm-efficiency", type=float, default=0.85, help="achieved fraction of 4.8 TB/s")
    ap.add_argument("--flops-efficiency", type=float, default=0.7, help="achieved fraction of 989 TFLOP/s")
    ap.add_argument("--nvlink-efficiency", type=float, default=0.8, help="achieved fraction of 450 GB/s per direction")
    ap.add_argument("--allreduce-latency-us", type=float, default=8.0, help="fixed cost of each NVLink collective")
    ap.add_argument("--usable-gib", type=float, default=139.0, help="GiB per GPU for weights + KV cache")


def assumptions_from(args: argparse.Namespace) -> Assumptions:
    return Assumptions(args.hbm_efficiency, args.flops_efficiency, args.nvlink_efficiency,
                       args.allreduce_latency_us, args.usable_gib)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_assumption_arguments(ap)
    ap.add_argument("--context", type=int, default=1024, help="tokens cached per sequence")
    ap.add_argument("--long-context", type=int, default=8192, help="second context for the batch-1 table")
    ap.add_argument("--batch", type=int, default=64, help="batch for the throughput table")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    a = assumptions_from(args)
    command = shlex.join(["python", "-m", "perf.cost_model_tensor_parallel", *sys.argv[1:]])
    out = ["# Tensor-parallel decode on H200: a paper model", "", f"    {command}", "",
           f"HBM {H200.hbm_tb_s} TB/s x {a.hbm_efficiency}, BF16 {H200.bf16_tflops:.0f} TFLOP/s x "
           f"{a.flops_efficiency}, NVLink bus {bus_bytes_per_s(H200, a) / 1e9:.0f} GB/s per direction, "
           f"{a.allreduce_latency_us:g} us per collective, {a.usable_gib:g} GiB per GPU for weights + KV cache; "
           "bf16 weights and KV cache. Every assumption: the module docstring."]
    for m in (LLAMA3_8B, LLAMA3_70B):
        out += ["", f"## {m.name}", ""] + batch1_table(m, args, a) + [""] + batched_table(m, args, a)
    out += ["", "## Published figures beside the model", ""] + published_table(a)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
