"""Benchmarks, profiles and cost models, each run from the repository root as a module
(`python -m perf.bench_engine --help`); their results live in perf/results/.

The modules they share, none of them an entry point:
    harness             in-process engine runs: step timing, greedy runs, agreement, sizes
    random_checkpoints  random-weight Llama checkpoints of set shapes, and draft/target pairs
    prompts             benchmark prompts: held-out code and chat, random tokens
    agentic_env         local environments for agent sessions: code edits, JSON tool calls, chat
    serving_load        the streaming load client a running server is measured with
    serving_metrics     what a load point reports (TTFT, TPOT, ITL, goodput under an SLO)
    serving_comparison  server variants against the baseline, as tables
    serving_plots       plots of load points
"""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "perf" / "results"  # every benchmark's results, committed or written by a run
BASELINE_REPOSITORY = REPO_ROOT / "perf" / "baseline_repository"  # HF `generate` behind Triton: serving's baseline
