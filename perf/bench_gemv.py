"""Small-batch linear layers: torch's matmul (cuBLAS) and the Triton gemv kernel against the
HBM ceiling, at the Llama-3.2-1B shapes.

At 1-16 rows a linear layer is bound by reading its weight once: bytes = out * in * itemsize
(+ the rows of x and of the output). Each call is timed alone with CUDA events after the L2 cache
is flushed, as in a real decode step, where the model's 2.4 GB of weights do not stay in L2.
Every timed variant is first checked against torch's result. Medians.

    python -m perf.bench_gemv                     # bf16, rows 1 4 8 16, default tiles
    python -m perf.bench_gemv --block-n 16 32 64 --block-k 128 256 512   # tile sweep
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

from backend.model.linear_tuner import time_call
from specserve_kernels.gemv import gemv

SHAPES_1B = {  # name -> (out, in)
    "qkv_proj": (3072, 2048), "o_proj": (2048, 2048), "gate_up_proj": (16384, 2048),
    "down_proj": (2048, 8192), "lm_head": (128256, 2048),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--block-n", type=int, nargs="*", default=[], help="tile heights to try (default: the wrapper's)")
    ap.add_argument("--block-k", type=int, nargs="*", default=[], help="tile widths to try")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--ceiling-tbps", type=float, default=4.25)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    dtype, device = DTYPES[args.dtype], torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    tiles = list(itertools.product(args.block_n or [None], args.block_k or [None]))
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, GPU us per call after an L2 flush (median of {args.iters}); "
          f"% of {args.ceiling_tbps} TB/s\n")
    print("| weight | out x in | rows | torch us | torch % | gemv us (tile) | gemv % | gemv / torch |")
    print("|---|---|---|---|---|---|---|---|")
    skipped: set[str] = set()
    for name, (n, k) in SHAPES_1B.items():
        w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
        for rows in args.rows:
            x = torch.randn(rows, k, device=device).to(dtype)
            expected = F.linear(x, w)
            nbytes = (n * k + rows * (n + k)) * dtype.itemsize
            torch_us = time_call(lambda: F.linear(x, w), flush, args.iters) * 1e6
            best = None
            for block_n, block_k in tiles:
                try:
                    got = gemv(x, w, block_n=block_n, block_k=block_k)
                except Exception as e:  # e.g. a tile whose pipelined loads exceed shared memory
                    skipped.add(f"{block_n}x{block_k} ({type(e).__name__})")
                    continue
                torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
                us = time_call(lambda: gemv(x, w, block_n=block_n, block_k=block_k), flush, args.iters) * 1e6
                if best is None or us < best[0]:
                    best = (us, block_n, block_k)
            if best is None:
                print(f"| {name} | {n} x {k} | {rows} | {torch_us:.1f} | | no tile ran | | |")
                continue
            us, block_n, block_k = best
            tile = "default" if block_n is None and block_k is None else f"{block_n or '-'}x{block_k or '-'}"
            pct = lambda t: nbytes / (t * 1e-6) / (args.ceiling_tbps * 1e12) * 100  # noqa: E731
            print(f"| {name} | {n} x {k} | {rows} | {torch_us:.1f} | {pct(torch_us):.0f}% | {us:.1f} ({tile}) | "
                  f"{pct(us):.0f}% | {us / torch_us:.2f} |")
    if skipped:
        print("\ntiles that did not run: " + ", ".join(sorted(skipped)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
