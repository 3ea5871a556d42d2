"""What the OpenAI-compatible layer adds: the same streamed requests through it and straight to
tritonserver over gRPC, alternating, in one run.

One tritonserver on the default model repository and serving/gateway/server.py beside it. Each of
N rounds sends one greedy streamed request both ways (the order alternating): gRPC with
client.stream.generate, OpenAI with the official client's streaming completions. Reported per path:
time to first token and time per output token after it (p50 and mean), and the ratios.

    python -m perf.bench_openai
    python -m perf.bench_openai --rounds 40 --max-tokens 64
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from client.stream import generate
from serving.launch.launcher import free_port, free_ports, start_server

PROMPT = "def parse_arguments(argv):"


def timed(chunks) -> tuple[float, float]:
    """(seconds to the first text, seconds per chunk after it) of one stream of text chunks."""
    start = time.perf_counter()
    times = [time.perf_counter() for text in chunks if text]
    first = times[0] - start
    return first, (times[-1] - times[0]) / max(len(times) - 1, 1)


def via_grpc(url: str, max_tokens: int):
    return (c.text for c in generate(url, PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True))


def via_openai(client, max_tokens: int):
    stream = client.completions.create(model="specserve", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    return (c.choices[0].text for c in stream if c.choices)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f} / {statistics.mean(values) * 1e3:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    import openai

    http_port, grpc_port, metrics_port = free_ports(3)
    handle = start_server(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                          log_file=Path("/dev/null"), log_level="warning", ready_timeout=600)
    port = free_port()
    api = subprocess.Popen([sys.executable, "-m", "serving.gateway.server", "--triton", handle.grpc_url,
                            "--port", str(port), "--host", "127.0.0.1"])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        results: dict[str, list[tuple[float, float]]] = {"gRPC to tritonserver": [], "OpenAI layer": []}
        paths = {"gRPC to tritonserver": lambda: via_grpc(handle.grpc_url, args.max_tokens),
                 "OpenAI layer": lambda: via_openai(client, args.max_tokens)}
        for name in paths:  # warm-up
            timed(paths[name]())
        for i in range(args.rounds):
            for name in (list(paths) if i % 2 == 0 else list(paths)[::-1]):
                results[name].append(timed(paths[name]()))
    finally:
        api.terminate()
        api.wait(10)
        handle.stop()
    print(f"`python -m perf.bench_openai --rounds {args.rounds} --max-tokens {args.max_tokens}`: one greedy "
          f"streamed request at a time, {args.max_tokens} tokens, alternating paths\n")
    print("| path | TTFT p50 / mean ms | per token after the first p50 / mean ms |")
    print("|---|---|---|")
    for name, values in results.items():
        print(f"| {name} | {summary([v[0] for v in values])} | {summary([v[1] for v in values])} |")
    grpc, layer = results["gRPC to tritonserver"], results["OpenAI layer"]
    ttft = statistics.median([v[0] for v in layer]) / statistics.median([v[0] for v in grpc])
    tpot = statistics.median([v[1] for v in layer]) / statistics.median([v[1] for v in grpc])
    print(f"\nOpenAI layer / gRPC (p50): TTFT {ttft:.2f}x, per token {tpot:.2f}x")


if __name__ == "__main__":
    main()
