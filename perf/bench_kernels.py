"""Decode and verification attention bandwidth: the Triton kernels and the torch reference
against the HBM ceiling.

Decode attention is bound by reading the KV cache: every context token's K and V row is read once
per (request, KV head), since the query heads of a GQA group share one read. Bytes counted:
    K and V   batch * context * num_kv_heads * head_dim * itemsize * 2
    q, out    batch * num_heads * head_dim * itemsize * 2
    metadata  block table rows in use (int32) + seq_lens + cu_seqlens_q
Achieved bandwidth = bytes / median time, against 4.25 TB/s (H200 device-to-device copy). The
torch reference moves more than this (it gathers the pages into a padded copy first); it is
charged the same useful bytes, so the two figures compare as speeds.

Correctness comes first: every timed variant is compared with the float32 reference on fresh
random inputs, and the run stops if one is wrong. Times are CUDA events around single calls after
warm-up; medians. The KV cache (512 MiB at the defaults) is far larger than L2.

    python -m perf.bench_kernels                           # batch 64, context 2048, 32/8 heads of 128, bf16
    python -m perf.bench_kernels --num-splits 1 2 4        # also time forced split-KV counts
    python -m perf.bench_kernels --batch 4 --context 32768 # small batch, long context: split-KV
    python -m perf.bench_kernels --head-dim 64 --batch 128 --min-context 128 --context 1024 --block-n 32 64 128
                                                           # the 1B shape's ragged decode, tile widths
    python -m perf.bench_kernels --batch 1 --queries 4 --num-splits 1   # a batch-1 verification of 3
                                                           # drafts (extend kernel), split-KV or not
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}  # atol = rtol


@dataclass(slots=True)
class DecodeInputs:
    q: torch.Tensor  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32 = arange
    seq_lens: torch.Tensor  # [batch] int32
    block_tables: torch.Tensor  # [batch, blocks_per_seq] int32, a random permutation of the pool
    scale: float

    def args(self) -> tuple:
        return self.q, self.k_cache, self.v_cache, self.cu_seqlens_q, self.seq_lens, self.block_tables, self.scale


def make_inputs(args: argparse.Namespace, dtype: torch.dtype, generator: torch.Generator) -> DecodeInputs:
    device = torch.device("cuda")
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    randn = lambda *s: torch.randn(*s, generator=generator, device=device, dtype=dtype)  # noqa: E731
    block_tables = torch.randperm(num_blocks, generator=generator, device=device).to(torch.int32)
    return DecodeInputs(
        q=randn(args.batch * args.queries, args.num_heads, args.head_dim),
        k_cache=randn(*shape),
        v_cache=randn(*shape),
        cu_seqlens_q=torch.arange(0, args.batch * args.queries + 1, args.queries, dtype=torch.int32, device=device),
        seq_lens=seq_lens(args).to(device),
        block_tables=block_tables.view(args.batch, blocks_per_seq),
        scale=args.head_dim**-0.5,
    )


def seq_lens(args: argparse.Namespace) -> torch.Tensor:
    """Every request at --context tokens, or ragged: uniform in [--min-context, --context]."""
    low = args.min_context or args.context
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(low, args.context + 1, (args.batch,), generator=g, dtype=torch.int32)


def bytes_read(args: argparse.Namespace, itemsize: int, lens: torch.Tensor) -> int:
    tokens = int(lens.sum())
    kv = tokens * args.num_kv_heads * args.head_dim * itemsize * 2
    q_out = args.batch * args.queries * args.num_heads * args.head_dim * itemsize * 2
    blocks = int((-(-lens // args.block_size)).sum())
    metadata = blocks * 4 + args.batch * 4 + (args.batch + 1) * 4
    return kv + q_out + metadata


def median_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048, help="tokens per request, all in the cache")
    parser.add_argument("--min-context", type=int, default=0,
                        help="ragged contexts: each request uniform in [min-context, context]")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--queries", type=int, default=1,
                        help="query tokens per request at the end of its context (k + 1 for a verification: "
                             "the extend kernel)")
    parser.add_argument("--num-splits", type=int, nargs="*", default=[],
                        help="also time the decode (or, with --queries > 1, extend) kernel with these split-KV counts")
    parser.add_argument("--block-n", type=int, nargs="*", default=[],
                        help="also time the decode kernel (1 split) with these K/V tile widths")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--ceiling-tbps", type=float, default=4.25, help="HBM bandwidth to compare against")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here; this benchmark times GPU kernels, nothing to do.")
        return 0

    from specserve_kernels.paged_attention import paged_attention, paged_attention_ref
    from specserve_kernels.paged_attention_decode import default_num_splits, paged_decode_attention
    from specserve_kernels.paged_attention_extend import paged_extend_attention

    dtype = DTYPES[args.dtype]
    inputs = make_inputs(args, dtype, torch.Generator(device="cuda").manual_seed(args.seed))
    hints = dict(max_seqlen_q=args.queries, max_seqlen_k=args.context)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    auto_splits = default_num_splits(args.batch, args.num_kv_heads, args.context, num_sms)
    variants: dict[str, Callable[[], torch.Tensor]] = {
        f"triton paged_attention (num_splits={auto_splits})": lambda: paged_attention(*inputs.args(), **hints),
    }
    kernel, kernel_name = (
        (paged_decode_attention, "decode") if args.queries == 1 else (paged_extend_attention, "extend"))
    for n in args.num_splits:
        variants[f"triton {kernel_name}, num_splits={n}"] = (
            lambda n=n: kernel(*inputs.args(), **hints, num_splits=n)
        )
    for n in args.block_n:
        variants[f"triton decode, 1 split, block_n={n}"] = (
            lambda n=n: paged_decode_attention(*inputs.args(), **hints, num_splits=1, block_n=n)
        )
    variants["torch paged_attention_ref"] = lambda: paged_attention_ref(*inputs.args(), **hints)

    context = f"{args.min_context}-{args.context}" if args.min_context else f"{args.context}"
    print(
        f"{kernel_name} attention: batch {args.batch} x {args.queries} queries, context {context}, "
        f"{args.num_heads} query heads, "
        f"{args.num_kv_heads} KV heads of {args.head_dim}, block size {args.block_size}, {args.dtype}, "
        f"{torch.cuda.get_device_name()} ({num_sms} SMs)"
    )
    f32 = [t.float() if t.is_floating_point() else t for t in inputs.args()[:-1]]
    expected = paged_attention_ref(*f32, inputs.scale, **hints)
    del f32
    tol = TOLERANCE[dtype]
    for name, fn in variants.items():
        out = fn().float()
        error = (out - expected).abs().max().item()
        ok = torch.allclose(out, expected, atol=tol, rtol=tol)
        print(f"  check {name}: max |error| vs float32 reference {error:.2e} ({'ok' if ok else 'WRONG'})")
        if not ok:
            print("bench_kernels: a variant disagrees with the float32 reference; not timing wrong kernels")
            return 1

    nbytes = bytes_read(args, inputs.q.element_size(), inputs.seq_lens.cpu())
    print(f"bytes read per call: {nbytes / 2**20:.1f} MiB; ceiling {args.ceiling_tbps} TB/s "
          f"= {nbytes / (args.ceiling_tbps * 1e12) * 1e6:.1f} us")
    print(f"  {'variant':<44} {'median us':>10} {'TB/s':>7} {'of ceiling':>10}")
    for name, fn in variants.items():
        ms = median_ms(fn, args.warmup, args.iters)
        tbps = nbytes / (ms * 1e-3) / 1e12
        print(f"  {name:<44} {ms * 1e3:>10.1f} {tbps:>7.2f} {tbps / args.ceiling_tbps:>10.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
