"""What one hostile request costs everyone else: the latency of a small request, alone and while
another client keeps sending a huge prompt (refused by its byte length before tokenizing), or the
largest prompt the byte bound lets through that still does not fit the context (tokenized, then
refused). Prints a table of medians and their ratio to the small request alone.

    python -m perf.bench_hostile                  # starts its own server on free ports
    python -m perf.bench_hostile --url localhost:8001
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

from serving.launch.launcher import DEFAULT_MODEL_REPOSITORY, free_ports, start_server
from serving.triton.request_builder import Preprocessor
from client.stream import GenerationError, complete


def small_latency(url: str, model: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        complete(url, "def main():", model=model, max_tokens=4, temperature=0.0, ignore_eos=True, timeout=120)
        times.append(time.perf_counter() - started)
    return times


def hammer(url: str, model: str, prompt: str, stop, counts) -> None:
    """Send `prompt` again and again until `stop`; count how each ends. A process of its own, so
    that building huge requests does not hold this client's GIL."""
    while not stop.is_set():
        try:
            complete(url, prompt, model=model, max_tokens=4, timeout=120)
            counts["accepted"] += 1
        except GenerationError:
            counts["refused"] += 1


def measure(url: str, model: str, prompt: str | None, n: int) -> tuple[list[float], dict]:
    if prompt is None:
        return small_latency(url, model, n), {"accepted": 0, "refused": 0}
    with multiprocessing.Manager() as manager:
        stop, counts = manager.Event(), manager.dict(accepted=0, refused=0)
        process = multiprocessing.Process(target=hammer, args=(url, model, prompt, stop, counts))
        process.start()
        time.sleep(1.0)  # the first huge request is in flight
        try:
            return small_latency(url, model, n), dict(counts)
        finally:
            stop.set()
            process.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="gRPC address of a running server (default: start one)")
    p.add_argument("--models", nargs="+", default=["llm", "llm_bls"])
    p.add_argument("--requests", type=int, default=30, help="small requests per measurement")
    p.add_argument("--huge-bytes", type=int, default=5_000_000)
    args = p.parse_args()
    handle = None
    url = args.url
    if url is None:
        log = Path(tempfile.mkdtemp()) / "tritonserver.log"
        http_port, grpc_port, metrics_port = free_ports(3)
        handle = start_server(
            DEFAULT_MODEL_REPOSITORY, http_port=http_port, grpc_port=grpc_port,
            metrics_port=metrics_port, log_file=log,
        )
        url = handle.grpc_url
    try:
        pre = Preprocessor.from_parameters({}, DEFAULT_MODEL_REPOSITORY)
        # text of ~1 byte per token: fits the byte bound, not the context, so it is tokenized
        just_in_bound = ("a " * pre.max_prompt_bytes)[: pre.max_prompt_bytes]
        loads = {
            "alone": None,
            f"{args.huge_bytes / 1e6:g} MB prompt (refused by bytes)": "x" * args.huge_bytes,
            f"{pre.max_prompt_bytes / 1e3:.0f} kB prompt (tokenized, too long)": just_in_bound,
        }
        print(f"max_model_len {pre.max_model_len}, max prompt bytes {pre.max_prompt_bytes}; "
              f"{args.requests} small requests (4 tokens) per row, medians")
        print("| model | beside | small request (ms) | vs alone | p90 (ms) | hostile requests refused |")
        print("|---|---|---|---|---|---|")
        for model in args.models:
            small_latency(url, model, 3)  # warm up
            alone = None
            for name, prompt in loads.items():
                times, counts = measure(url, model, prompt, args.requests)
                median = statistics.median(times)
                alone = alone or median
                p90 = sorted(times)[int(0.9 * (len(times) - 1))]
                refused = "" if prompt is None else f"{counts['refused']} of {counts['refused'] + counts['accepted']}"
                print(f"| {model} | {name} | {median * 1e3:.1f} | {median / alone:.2f}x | {p90 * 1e3:.1f} | {refused} |")
    finally:
        if handle is not None:
            handle.stop()


if __name__ == "__main__":
    main()
