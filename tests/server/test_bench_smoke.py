"""The serving benchmark end to end on a few short requests: sane JSON, plots, and the baseline."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from perf import BASELINE_REPOSITORY
from perf.serving_load import Workload, run_point
from perf.serving_metrics import SLO
from serving.launch.launcher import free_ports, start_server
from serving.launch.repository_variants import make_repository

pytestmark = pytest.mark.server
REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_REQUESTS, OUTPUT_TOKENS = 4, 8


def check_point(point: dict) -> None:
    assert (point["completed"], point["failed"], point["errors"]) == (NUM_REQUESTS, 0, {})
    assert point["total_output_tokens"] == NUM_REQUESTS * OUTPUT_TOKENS
    assert point["total_input_tokens"] >= NUM_REQUESTS
    assert point["duration_s"] > 0
    assert point["request_throughput"] == pytest.approx(NUM_REQUESTS / point["duration_s"])
    assert point["output_throughput"] == pytest.approx(NUM_REQUESTS * OUTPUT_TOKENS / point["duration_s"])
    assert 0.0 <= point["goodput"] <= point["request_throughput"]
    assert 0.0 <= point["slo_attainment"] <= 1.0
    ttft, e2e = point["ttft_s"], point["e2e_latency_s"]
    assert 0.0 < ttft["min"] <= ttft["p50"] <= ttft["p90"] <= ttft["p99"] <= ttft["max"]
    assert ttft["max"] <= e2e["max"]
    assert e2e["max"] < point["duration_s"] + 1e-6


def test_bench_serving_writes_json_and_plots(server, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "perf.bench_serving", "--url", server.grpc_url,
        "--dataset", "random", "--tokenizer", str(server.model_dir), "--input-tokens", "8", "16",
        "--num-prompts", str(NUM_REQUESTS), "--output-tokens", str(OUTPUT_TOKENS),
        "--request-rates", "20", "--concurrencies", "2", "--warmup", "0", "--no-prompt-cache",
        "--out", str(out),
    ]
    subprocess.run(cmd, check=True, timeout=300, cwd=REPO_ROOT)
    results = json.loads(out.read_text())
    assert results["config"]["output_tokens"] == OUTPUT_TOKENS
    rate, concurrency = results["points"]
    assert (rate["request_rate"], rate["concurrency"]) == (20.0, None)
    assert (concurrency["request_rate"], concurrency["concurrency"]) == (None, 2)
    for point in results["points"]:
        check_point(point)
        assert point["slo"] == {"ttft": 1.0, "tpot": 0.1}
        assert point["tpot_s"]["p50"] > 0 and point["itl_s"]["p50"] > 0  # streamed token by token
    for name in ("bench_latency_vs_rate.png", "bench_throughput_vs_concurrency.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_baseline_serves_the_benchmark_in_one_response(server, tmp_path):
    repository = make_repository(BASELINE_REPOSITORY, tmp_path / "baseline",
                                 {"hf_generate": {"model": str(server.model_dir), "num_threads": "1"}})
    http_port, grpc_port, metrics_port = free_ports(3)
    handle = start_server(repository, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                          log_file=tmp_path / "tritonserver.log", ready_timeout=300)
    try:
        workload = Workload(["def f(x):", "import os", "class A:", "x = ["], OUTPUT_TOKENS)
        point = asyncio.run(run_point(handle.grpc_url, "hf_generate", workload, SLO(), concurrency=2, warmup=0))
    finally:
        handle.stop()
    check_point(point)
    assert point["ttft_s"]["p50"] == point["e2e_latency_s"]["p50"]  # the whole completion at once
    assert point["tpot_s"]["max"] == 0.0
