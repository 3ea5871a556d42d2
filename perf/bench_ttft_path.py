"""Where time to first token goes on the way in: the same short prompt, one request at a time,
through each layer of the served path in one run, side by side with the engine in this process.

    in-process      EngineLoop over the served config (built after the server has stopped)
    llm_engine      gRPC stream straight to the engine model, token ids in (what llm_bls sends)
    llm             the ensemble: preprocessing -> llm_engine
    llm_bls         preprocessing in its own stub, then a gRPC stream to llm_engine
    openai          streamed /v1/completions through serving.gateway.server -> llm

Each request asks for --max-tokens tokens (greedy, EOS ignored); TTFT is the time to its first
response with text, p50 and min over --requests after --warmup; the request is then dropped. Prefix caching is switched off so that every request
prefills its whole prompt.

    python -m perf.bench_ttft_path                                  # int4, 2 threads, compiled
    python -m perf.bench_ttft_path --quantization none --no-compile
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.engine_loop import EngineLoop
from client.stream import generate
from perf.serving_load import wait_for
from serving.triton.engine_stream import EngineStream
from serving.launch.launcher import DEFAULT_MODEL_REPOSITORY, free_port, free_ports, start_server
from serving.triton.request_builder import Preprocessor
from serving.launch.repository_variants import make_repository

PROMPT = "Write a haiku about the sea."
SETTLE_S = 0.2  # after dropping a request, for the engine to let it go (a cancellation is polled)
PATH_PARAMETERS = ("model", "tokenizer", "draft_model")  # relative to llm_engine's directory


def engine_parameters(config: str, model_dir: Path) -> dict[str, str]:
    values = dict(re.findall(r'key:\s*"(\w+)"\s*,\s*value:\s*\{\s*string_value:\s*"([^"]*)"', config))
    for key in PATH_PARAMETERS:
        if values.get(key, "").strip() and not Path(values[key]).is_absolute():
            values[key] = str(model_dir / values[key])
    for key in ("engine_process", "max_pending_requests", "gpu_device_ids"):  # the adapter's, not the engine's
        values.pop(key, None)
    return values


def timed(send: Callable[[], Callable[[], None]], warmup: int, requests: int) -> list[float]:
    """Seconds each `send()` took; what it returns (dropping the request) runs off the clock."""
    for _ in range(warmup):
        send()()
        time.sleep(SETTLE_S)
    took = []
    for _ in range(requests):
        start = time.perf_counter()
        drop = send()
        took.append(time.perf_counter() - start)
        drop()
        time.sleep(SETTLE_S)
    return took


def first_text(chunks) -> Callable[[], None]:
    for chunk in chunks:
        if chunk.text:
            break
    return chunks.close


def via_engine_model(url: str, inputs: dict) -> Callable[[], None]:
    def send():
        stream = EngineStream(url, "llm_engine", uuid.uuid4().hex, inputs)
        while True:
            outputs, last = stream.next(timeout=60)
            text = outputs.get("text_output")
            if last or (text is not None and text.size and text.reshape(-1)[0]):
                return stream.close
    return send


def via_openai(base: str, max_tokens: int) -> Callable[[], None]:
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()

    def send():
        request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        response = urllib.request.urlopen(request, timeout=60)
        for line in response:
            if line.startswith(b"data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                break
        return response.close
    return send


def in_process(parameters: dict[str, str], prompt_ids: list[int], params, warmup: int, requests: int) -> list[float]:
    loop = EngineLoop.build(lambda: LLMEngine(EngineConfig.from_strings(parameters)))
    try:
        def send():
            done = threading.Event()
            request_id = uuid.uuid4().hex
            loop.add(request_id, prompt_ids, params, lambda output: (output.text or output.finished) and done.set())
            done.wait(60)
            return lambda: loop.abort(request_id)
        return timed(send, warmup, requests)
    finally:
        loop.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", default="int4")
    p.add_argument("--threads", type=int, default=2, help="the engine's torch threads")
    p.add_argument("--no-compile", action="store_true", help="leave compile_decode off")
    p.add_argument("--plain", action="store_true", help="no speculation (speculative_method none)")
    p.add_argument("--compile-prefill", action="store_true", help="compile_prefill on")
    p.add_argument("--max-tokens", type=int, default=1, help="tokens each request asks for (TTFT: the first text)")
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    overrides = {"quantization": args.quantization, "num_threads": str(args.threads), "enable_prefix_caching": "false",
                 "compile_decode": str(not args.no_compile).lower(), "compile_prefill": str(args.compile_prefill).lower()}
    if args.plain:
        overrides["speculative_method"] = "none"
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="specserve-ttft-") as tmp:
        repository = make_repository(DEFAULT_MODEL_REPOSITORY, Path(tmp) / "repository", {"llm_engine": overrides})
        engine_dir = (repository / "llm_engine").resolve()
        parameters = engine_parameters((repository / "llm_engine" / "config.pbtxt").read_text(), engine_dir)
        preprocessor = Preprocessor.from_parameters({"tokenizer": parameters["model"]}, repository)
        request = preprocessor({"text_input": np.array([PROMPT.encode()], dtype=np.object_),
                                "max_tokens": np.array([args.max_tokens], dtype=np.int32),
                                "ignore_eos": np.array([True]), "stream": np.array([True]),
                                "temperature": np.array([0.0], dtype=np.float32)})
        inputs = request.engine_inputs()
        http_port, grpc_port, metrics_port = free_ports(3)
        handle = start_server(repository, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                              log_file=Path(tmp) / "server.log", log_level="warning", ready_timeout=600)
        port = free_port()
        api = subprocess.Popen([sys.executable, "-m", "serving.gateway.server", "--triton", handle.grpc_url,
                                "--port", str(port), "--host", "127.0.0.1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = handle.grpc_url
            results["llm_engine (token ids)"] = timed(via_engine_model(url, inputs), args.warmup, args.requests)
            for model in ("llm", "llm_bls"):
                def send(model=model):
                    return first_text(generate(url, PROMPT, model=model, max_tokens=args.max_tokens, temperature=0,
                                        ignore_eos=True, timeout=60))
                results[model] = timed(send, args.warmup, args.requests)
            base = f"http://127.0.0.1:{port}"
            wait_for(f"{base}/health", 60)
            results["openai /v1/completions"] = timed(via_openai(base, args.max_tokens), args.warmup, args.requests)
        finally:
            api.terminate()
            api.wait(30)
            handle.stop()
        results = {"in-process EngineLoop": in_process(parameters, request.input_ids, request.params, args.warmup,
                                                       args.requests)} | results
    print(f"\nTTFT of a {len(request.input_ids)}-token prompt, {args.max_tokens} tokens asked, one request at a time; "
          f"{args.quantization}, {args.threads} engine threads, compile_decode {overrides['compile_decode']}, "
          f"{args.requests} requests after {args.warmup} warm-up\n")
    base_p50 = statistics.median(results["in-process EngineLoop"])
    print("| path | TTFT p50 | min | over in-process (p50) |")
    print("|---|---:|---:|---:|")
    for name, took in results.items():
        p50 = statistics.median(took)
        print(f"| {name} | {p50 * 1e3:.1f} ms | {min(took) * 1e3:.1f} ms | +{(p50 - base_p50) * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
