"""A cost model, on paper, of decode with tensor parallelism (TP) inside a node and pipeline parallelism (PP)
across nodes: Llama-3.1-405B (and Llama-3-70B for comparison) on 2 nodes of 8 NVIDIA H200s.
Pure arithmetic, standard library only, no GPU. Builds on perf/cost_model_tensor_parallel.py: the model
shapes, per-rank weight/KV bytes and FLOPs, the NVLink collective cost and the H200 constants are
imported from it, and its assumptions (its module docstring) hold here too.

    python -m perf.cost_model_pipeline_parallel                       # the tables, in markdown
    python -m perf.cost_model_pipeline_parallel --batch 16 --context 8192 --ib-gbit 200

Assumptions (the ones with a default are command-line options):
- Llama-3.1-405B shape: hidden 16384, 126 layers, 128 heads, 8 KV heads of 128, MLP 53248, vocab
  128256, untied lm_head. Weights, KV cache and communicated activations are bf16 (2 bytes), except
  in the rows evaluated under a published figure's own conditions (fp8 weights there, KV still bf16).
- Cluster: 2 nodes x 8 H200 SXM (NVLink 4 + NVSwitch inside a node, constants of
  cost_model_tensor_parallel). Between nodes, InfiniBand at --ib-gbit (default 400 Gb/s) PER GPU, one
  NIC per GPU (the DGX/HGX H200 rail layout, 8 x 400 Gb/s = 3.2 Tb/s per node), one direction, times
  --ib-efficiency (default 0.8): 40 GB/s per GPU.
- Pipeline split: layers divided as evenly as possible into PP stages (126 / 2 = 63 each). Stage 0
  also stores the vocab-parallel embedding (1/TP per rank; the lookup reads B rows: neglected); the
  last stage stores and reads the lm_head (1/TP per rank) and the final norm.
- One stage's step for one micro-batch of B sequences with L cached tokens: max(HBM bytes / bandwidth,
  FLOPs / compute) + its TP collectives, as in cost_model_tensor_parallel: 2 all-reduces per layer of
  B x hidden x 2 bytes, plus the embedding all-reduce on stage 0 and the logits gather on the last.
  Inside a node they run over NVLink (cost_model_tensor_parallel.collective_s). Communication does not
  overlap compute; host overhead, launch gaps and sampling are not modelled.
- Stage boundary: the hidden states, B x hidden x 2 bytes, go from each TP rank of stage s to the same
  rank of stage s+1 over that GPU's own NIC (all ranks in parallel): --p2p-latency-us (default 8 us)
  + bytes / IB bandwidth. The sampled token ids (B x 4 bytes) go back from the last stage to stage 0
  for the next step, one more such transfer. A boundary inside one node uses NVLink with the same
  latency.
- TP=16 across both nodes: every all-reduce is a 16-GPU ring that crosses the nodes, so its bus
  bandwidth is the IB bandwidth per GPU, and it pays --ib-allreduce-latency-us (default 20 us) instead
  of the NVLink latency. With 8 KV heads, each KV head is replicated on 2 ranks.
- Pipeline schedule: k micro-batches in flight (1 <= k <= PP), each of B sequences. One micro-batch
  needs one pass through all stages and transfers per token, so a request's time per token is
  cycle = max(sum of stage times + (PP-1) forward transfers + 1 token return,
  k x slowest stage time): with k = 1 only one stage
  works at a time (each is idle about (PP-1)/PP of the time); with k = PP and balanced stages the
  stages are all busy and tokens/s is ~PP x higher at the same per-token latency (slightly higher when
  the last stage, with the lm_head, is the slowest). Aggregate tokens/s = k x B / cycle.
- Memory: --usable-gib per GPU for weights + KV cache (cost_model_tensor_parallel's default 139 GiB). The KV
  cache of all k x B sequences is held: each stage holds its own layers' KV for every micro-batch.
- Shares in the table: stage idle share = 1 - (mean stage busy time per cycle) / cycle; communication
  share = (TP collectives + stage-boundary transfers) / (time of one micro-batch's pass).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, replace

import perf.cost_model_tensor_parallel as tpm
from perf.cost_model_tensor_parallel import GIB, H200, LLAMA3_70B, Assumptions, Gpu, ModelShape, StepTime

LLAMA31_405B = ModelShape("Llama-3.1-405B", 16384, 126, 128, 8, 128, 53248, 128256)
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float   # one direction, achieved
    latency_s: float     # fixed cost per message or collective


@dataclass(frozen=True)
class Cluster:
    gpu: Gpu
    nvlink: Link         # inside a node: collectives and point-to-point
    ib: Link             # between nodes: point-to-point, one NIC per GPU
    ib_allreduce: Link   # a ring collective that crosses nodes


@dataclass(frozen=True)
class Config:
    label: str
    tp: int
    pp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def tp_crosses_nodes(self) -> bool:
        return self.tp > GPUS_PER_NODE

    @property
    def pp_crosses_nodes(self) -> bool:
        return self.gpus > GPUS_PER_NODE and not self.tp_crosses_nodes


@dataclass(frozen=True)
class Pipeline:
    stages: list[StepTime]  # per stage: its layers' memory, compute and tensor-parallel time
    transfer_s: float    # one forward stage-boundary transfer (hidden states)
    return_s: float      # the sampled token ids back to stage 0 (0 when PP = 1)

    @property
    def transfers_s(self) -> float:
        return (len(self.stages) - 1) * self.transfer_s + self.return_s

    @property
    def pass_s(self) -> float:
        return sum(s.total_s for s in self.stages) + self.transfers_s

    @property
    def comm_s(self) -> float:
        return sum(s.comm_s for s in self.stages) + self.transfers_s

    def cycle_s(self, in_flight: int) -> float:
        return max(self.pass_s, in_flight * max(s.total_s for s in self.stages))

    def idle_share(self, in_flight: int) -> float:
        busy = in_flight * sum(s.total_s for s in self.stages) / len(self.stages)
        return 1 - busy / self.cycle_s(in_flight)


# ---- per-stage arithmetic, built on cost_model_tensor_parallel's whole-model functions ----

def stage_layers(m: ModelShape, pp: int) -> list[int]:
    base, extra = divmod(m.layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def lm_head_params_per_rank(m: ModelShape, tp: int) -> float:
    return m.vocab * m.hidden / tp


def layer_params_per_rank(m: ModelShape, tp: int) -> float:
    """One decoder layer's matmul weights on one rank (cost_model_tensor_parallel counts the lm_head too)."""
    return tpm.matmul_params_per_rank(replace(m, layers=1), tp) - lm_head_params_per_rank(m, tp)


def stage_read_bytes_per_rank(m: ModelShape, tp: int, layers: int, last: bool, a: Assumptions) -> float:
    params = layers * (layer_params_per_rank(m, tp) + 2 * m.hidden)  # + the layer's two RMSNorms
    if last:
        params += lm_head_params_per_rank(m, tp) + m.hidden
    return params * a.weight_bytes


def stage_stored_bytes_per_rank(m: ModelShape, tp: int, layers: int, first: bool, last: bool,
                                a: Assumptions) -> float:
    embedding = lm_head_params_per_rank(m, tp) * a.weight_bytes if first else 0.0
    return stage_read_bytes_per_rank(m, tp, layers, last, a) + embedding


def stage_kv_bytes_per_token_per_rank(m: ModelShape, tp: int, layers: int) -> float:
    return tpm.kv_bytes_per_token_per_rank(replace(m, layers=layers), tp)


def stage_flops_per_rank(m: ModelShape, tp: int, layers: int, last: bool, batch: int, context: int) -> float:
    one_layer = tpm.step_flops_per_rank(replace(m, layers=1), tp, batch, context) \
        - batch * 2 * lm_head_params_per_rank(m, tp)
    return layers * one_layer + (batch * 2 * lm_head_params_per_rank(m, tp) if last else 0.0)


def link_s(nbytes: float, link: Link) -> float:
    return link.latency_s + nbytes / link.bytes_per_s


def stage_tp_comm_s(m: ModelShape, cfg: Config, layers: int, first: bool, last: bool, batch: int,
                    cl: Cluster, a: Assumptions) -> float:
    tp = cfg.tp
    if tp == 1:
        return 0.0
    allreduce_bytes = 2 * (tp - 1) / tp * batch * m.hidden * 2
    gather_bytes = (tp - 1) / tp * batch * m.vocab * 2
    if cfg.tp_crosses_nodes:
        allreduce, gather = link_s(allreduce_bytes, cl.ib_allreduce), link_s(gather_bytes, cl.ib_allreduce)
    else:
        allreduce = tpm.collective_s(allreduce_bytes, cl.gpu, a)
        gather = tpm.collective_s(gather_bytes, cl.gpu, a)
    return (2 * layers + (1 if first else 0)) * allreduce + (gather if last else 0.0)


def pipeline(m: ModelShape, cfg: Config, batch: int, context: int, cl: Cluster, a: Assumptions) -> Pipeline:
    hbm, flops = tpm.hbm_bytes_per_s(cl.gpu, a), tpm.flops_per_s(cl.gpu, a)
    stages = []
    for s, layers in enumerate(stage_layers(m, cfg.pp)):
        first, last = s == 0, s == cfg.pp - 1
        nbytes = stage_read_bytes_per_rank(m, cfg.tp, layers, last, a) \
            + batch * context * stage_kv_bytes_per_token_per_rank(m, cfg.tp, layers)
        stages.append(StepTime(nbytes / hbm,
                               stage_flops_per_rank(m, cfg.tp, layers, last, batch, context) / flops,
                               stage_tp_comm_s(m, cfg, layers, first, last, batch, cl, a)))
    boundary = cl.ib if cfg.pp_crosses_nodes else cl.nvlink
    if cfg.pp == 1:
        return Pipeline(stages, 0.0, 0.0)
    return Pipeline(stages, link_s(batch * m.hidden * 2, boundary), link_s(batch * 4, boundary))


def weights_gib(m: ModelShape, cfg: Config, a: Assumptions) -> float:
    """The largest per-GPU weight footprint over the stages."""
    layers = stage_layers(m, cfg.pp)
    return max(stage_stored_bytes_per_rank(m, cfg.tp, n, s == 0, s == cfg.pp - 1, a)
               for s, n in enumerate(layers)) / GIB


def kv_room_gib(m: ModelShape, cfg: Config, a: Assumptions) -> float:
    return a.usable_gib - weights_gib(m, cfg, a)


def max_sequences(m: ModelShape, cfg: Config, context: int, a: Assumptions) -> int:
    """Sequences of `context` tokens whose KV fits on every GPU (all micro-batches together)."""
    per_seq = max(stage_kv_bytes_per_token_per_rank(m, cfg.tp, n) for n in stage_layers(m, cfg.pp)) * context
    return int(max(0.0, kv_room_gib(m, cfg, a)) * GIB // per_seq)


# ---- tables ----

def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def fit_table(models: list[ModelShape], configs: list[Config], context: int, a: Assumptions) -> list[str]:
    lines = [f"| model | configuration | GPUs | weights GiB/GPU (largest stage) | KV room GiB/GPU "
             f"| max sequences @ {context} tokens |", "|---|---|---|---|---|---|"]
    for m in models:
        for cfg in configs:
            room = kv_room_gib(m, cfg, a)
            fits = f"{room:.1f}" if room > 0 else "does not fit"
            lines.append(f"| {m.name} | {cfg.label} | {cfg.gpus} | {weights_gib(m, cfg, a):.1f} | {fits} "
                         f"| {max_sequences(m, cfg, context, a) if room > 0 else '-'} |")
    return lines


def stage_table(m: ModelShape, configs: list[Config], batch: int, context: int, cl: Cluster,
                a: Assumptions) -> list[str]:
    lines = ["| configuration | stage | layers | HBM ms | compute ms | TP comm ms | stage ms | boundary transfer ms |",
             "|---|---|---|---|---|---|---|---|"]
    for cfg in configs:
        p = pipeline(m, cfg, batch, context, cl, a)
        for s, (st, n) in enumerate(zip(p.stages, stage_layers(m, cfg.pp))):
            xfer = ms(p.transfer_s) if cfg.pp > 1 else "-"
            lines.append(f"| {cfg.label} | {s} | {n} | {ms(st.memory_s)} | {ms(st.compute_s)} | {ms(st.comm_s)} "
                         f"| {ms(st.total_s)} | {xfer} |")
    return lines


def schedule_table(m: ModelShape, configs: list[Config], batches: list[int], context: int, cl: Cluster,
                   a: Assumptions) -> list[str]:
    lines = ["| configuration | B per micro-batch | batches in flight | ms/token per request | aggregate tok/s "
             "| tok/s per request | stage idle share | communication share | KV fits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for batch in batches:
        for cfg in configs:
            if kv_room_gib(m, cfg, a) <= 0:
                lines.append(f"| {cfg.label} | {batch} | - | weights do not fit | - | - | - | - | - |")
                continue
            p, room = pipeline(m, cfg, batch, context, cl, a), max_sequences(m, cfg, context, a)
            for k in sorted({1, cfg.pp}):
                cycle = p.cycle_s(k)
                fits = "yes" if room >= k * batch else f"no (max {room} sequences)"
                lines.append(f"| {cfg.label} | {batch} | {k} | {ms(cycle)} | {k * batch / cycle:,.0f} "
                             f"| {1 / cycle:.1f} | {p.idle_share(k):.0%} | {p.comm_s / p.pass_s:.0%} | {fits} |")
    return lines


# ---- published figures ----

FP8_H200 = replace(H200, name="H200 SXM, FP8", bf16_tflops=2 * H200.bf16_tflops)  # 1979 TFLOP/s dense FP8
NVIDIA_TP_VS_PP = "https://blockchain.news/news/llama-3-1-405b-throughput-boost-nvidia-h200-gpus-nvlink"
NVIDIA_TP_VS_PP_ORIGINAL = ("https://developer.nvidia.com/blog/boosting-llama-3-1-405b-throughput-by-another-"
                            "1-5x-on-nvidia-h200-tensor-core-gpus-and-nvlink-switch/")
NVIDIA_MODELOPT = "https://3acesnews.com/nvidia-enhances-llama-3-1-405b-performance-with-tensorrt-model-optimizer"


def prefill_s_per_request(m: ModelShape, tokens: int, gpus: int, gpu: Gpu, a: Assumptions) -> float:
    """Compute-bound prefill of one request spread over all GPUs: 2 x params x tokens + causal attention."""
    params = tpm.matmul_params_per_rank(m, 1)
    attention = 2 * m.heads * m.head_dim * tokens * tokens * m.layers
    return (2 * params * tokens + attention) / (gpus * tpm.flops_per_s(gpu, a))


def published_table(context: int, cl: Cluster, a: Assumptions) -> list[str]:
    fp8 = replace(a, weight_bytes=1.0)
    fp8_cluster = replace(cl, gpu=FP8_H200)
    m = LLAMA31_405B
    tp8, pp8 = Config("TP=8", 8, 1), Config("PP=8 (one node)", 1, 8)

    # 1. TP8 vs PP8 at minimum latency (batch 1), one HGX H200, FP8: published ratio 5.6x.
    t_tp8 = pipeline(m, tp8, 1, context, fp8_cluster, fp8).cycle_s(1)
    t_pp8 = pipeline(m, pp8, 1, context, fp8_cluster, fp8).cycle_s(1)
    model_ratio = t_pp8 / t_tp8

    # 2. Maximum throughput, 8 x H200, FP8, 2048 in / 128 out: 463.1 output tok/s; batch not published.
    isl, osl, published_tok_s = 2048, 128, 463.1
    batch = min(max_sequences(m, tp8, isl + osl, fp8), 1024)
    decode = pipeline(m, tp8, batch, isl + osl // 2, fp8_cluster, fp8).cycle_s(1)
    prefill = prefill_s_per_request(m, isl, tp8.gpus, FP8_H200, fp8)
    model_tok_s = batch * osl / (batch * prefill + osl * decode)

    return [
        "| source | conditions | published | model | published / model |", "|---|---|---|---|---|",
        f"| [NVIDIA, TP vs PP on HGX H200]({NVIDIA_TP_VS_PP}) (reporting [the NVIDIA blog]({NVIDIA_TP_VS_PP_ORIGINAL})) "
        f"| Llama-3.1-405B FP8, TensorRT-LLM, 8 x H200 in one node, minimum-latency scenario; sequence lengths not "
        f"given in the text found: the model uses batch 1 at {context} cached tokens | TP8 is 5.6x faster than PP8 "
        f"| TP8 {ms(t_tp8)} ms/token, PP8 {ms(t_pp8)} ms/token: {model_ratio:.1f}x | {5.6 / model_ratio:.2f}x |",
        f"| [NVIDIA, TensorRT Model Optimizer FP8]({NVIDIA_MODELOPT}) (reproducing NVIDIA's table) "
        f"| Llama-3.1-405B FP8, TensorRT-LLM, 8 x H200 (one HGX node), maximum throughput, {isl} in / {osl} out; "
        f"batch not published: the model uses {batch} sequences (the most whose bf16 KV fits, capped at 1024), "
        f"prefill at full FP8 compute on all 8 GPUs, not overlapped with decode "
        f"| {published_tok_s} output tok/s | {model_tok_s:.1f} output tok/s | {published_tok_s / model_tok_s:.2f}x |",
        "",
        "No published Llama-3.1-405B figure for 2 nodes x 8 H200 with TP=8 x PP=2 (or TP=16) over InfiniBand was "
        "found with usable conditions (batch, sequence lengths, interconnect), so the two-node rows above have no "
        "published counterpart here. Both comparisons are single-node and FP8, evaluated with the same model "
        "(weights 1 byte, FP8 peak 1979 TFLOP/s x the same efficiency, KV cache kept bf16). The 5.6x is the "
        "ratio as reported; a reader comment on the blog's forum thread suggests its Table 1 swapped the TP and PP "
        "minimum-latency entries, which does not change the ratio. The throughput row "
        "depends on the assumed batch and on prefill, which dominates at 2048 in / 128 out."]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64, help="sequences per micro-batch")
    ap.add_argument("--context", type=int, default=4096, help="tokens cached per sequence")
    ap.add_argument("--ib-gbit", type=float, default=400.0, help="InfiniBand Gb/s per GPU, one direction")
    ap.add_argument("--ib-efficiency", type=float, default=0.8, help="achieved fraction of --ib-gbit")
    ap.add_argument("--p2p-latency-us", type=float, default=8.0, help="fixed cost of a stage-boundary send")
    ap.add_argument("--ib-allreduce-latency-us", type=float, default=20.0,
                    help="fixed cost of an all-reduce that crosses nodes (TP=16)")
    tpm.add_assumption_arguments(ap)
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    a = tpm.assumptions_from(args)
    ib_bytes = args.ib_gbit / 8 * 1e9 * args.ib_efficiency
    cl = Cluster(H200,
                 Link("NVLink", tpm.bus_bytes_per_s(H200, a), args.p2p_latency_us * 1e-6),
                 Link("InfiniBand", ib_bytes, args.p2p_latency_us * 1e-6),
                 Link("InfiniBand ring", ib_bytes, args.ib_allreduce_latency_us * 1e-6))
    configs = [Config("TP=8 x PP=2 (2 nodes)", 8, 2), Config("TP=16 (2 nodes, all-reduce over IB)", 16, 1),
               Config("TP=8 x PP=1 (1 node)", 8, 1)]
    batches = sorted({1, args.batch})
    command = shlex.join(["python", "-m", "perf.cost_model_pipeline_parallel", *sys.argv[1:]])
    out = ["# Pipeline-parallel decode across two H200 nodes: a paper model", "", f"    {command}", "",
           f"HBM {H200.hbm_tb_s} TB/s x {a.hbm_efficiency}, BF16 {H200.bf16_tflops:.0f} TFLOP/s x "
           f"{a.flops_efficiency}, NVLink bus {cl.nvlink.bytes_per_s / 1e9:.0f} GB/s per direction with "
           f"{a.allreduce_latency_us:g} us per collective, InfiniBand {args.ib_gbit:g} Gb/s per GPU x "
           f"{args.ib_efficiency} = {ib_bytes / 1e9:.0f} GB/s per GPU per direction, {args.p2p_latency_us:g} us per "
           f"stage-boundary send, {args.ib_allreduce_latency_us:g} us per cross-node all-reduce, "
           f"{a.usable_gib:g} GiB per GPU for weights + KV cache; bf16 weights and KV cache; {args.context} tokens "
           "cached per sequence. Every assumption: the module docstring.",
           "", "## Does it fit?", "", *fit_table([LLAMA31_405B, LLAMA3_70B], configs, args.context, a)]
    for m in (LLAMA31_405B, LLAMA3_70B):
        out += ["", f"## {m.name}: per-stage step at B = {args.batch}, {args.context} tokens cached", "",
                *stage_table(m, configs, args.batch, args.context, cl, a),
                "", f"## {m.name}: pipeline schedule", "",
                *schedule_table(m, configs, batches, args.context, cl, a)]
    out += ["", "## Published figures beside the model", "", *published_table(args.context, cl, a)]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
