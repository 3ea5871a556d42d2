"""A target and draft pair with random weights whose greedy acceptance is set: for measuring
speculative decoding at a model shape when no trained pair of that shape is at hand (a GPU run).
How the pair is made: perf/random_checkpoints.py (`write_pair`).

    python -m perf.spec_pair OUT_DIR --shape 1b --acceptance 0.7     # on a GPU
    python -m perf.spec_pair OUT_DIR --shape tiny --acceptance 0.7   # a CPU smoke run
then OUT_DIR/target and OUT_DIR/draft go to `python -m perf.bench_speculative --target/--draft`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from perf.random_checkpoints import SHAPES, write_pair


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--acceptance", type=float, default=0.7, help="greedy agreement wanted (0-1)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    found = write_pair(args.out, SHAPES[args.shape], args.acceptance, device, dtype)
    print(f"{args.shape} pair in {args.out}: eps {found['eps']:.4f}, greedy agreement {found['agreement']:.3f} "
          f"(wanted {args.acceptance}), draft 1 layer of {found['target_layers']}")


if __name__ == "__main__":
    main()
