"""The streaming load client: requests sent to a running server, as its users see them.

Prompts come from a dataset (code cut from held-out standard-library files, or random tokens),
are sent over the tritonclient gRPC stream to a model (the `llm` ensemble by default) either with
Poisson arrivals at a request rate or at a fixed concurrency, and every response is timestamped on
arrival; each load point is summarized as perf/serving_metrics.py defines. perf/bench_serving.py
runs it against one server, perf/sweep_serving.py against several it starts itself.

A model with max_batch_size > 0 (a dynamic batcher) gets each input with a batch dimension of 1,
and only the inputs it declares: the client reads the model's config first.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from client.stream import INPUT_TYPES, request_inputs
from perf.prompts import DEFAULT_TARGET, REPO_ROOT, code_prompts, random_prompts
from perf.serving_metrics import SLO, RequestRecord, summarize

PROMPT_CACHE = REPO_ROOT / ".cache" / "bench_prompts"  # reading the held-out files takes seconds
MAX_ERROR_CHARS = 200


@dataclass(slots=True)
class Workload:
    prompts: list[str]
    output_tokens: int  # max_tokens of every request, generated in full (ignore_eos)
    temperature: float = 0.0
    seed: int = 0  # request i is sampled with seed + i


def load_prompts(
    tokenizer_dir: str | Path, dataset: str, n: int, min_tokens: int, max_tokens: int, seed: int = 0,
    cache: bool = True,
) -> list[str]:
    """n prompt texts of min..max tokens: `code` from held-out files, or `random` tokens.
    Cached in PROMPT_CACHE."""
    tokenizer_key = hashlib.sha1(str(Path(tokenizer_dir).resolve()).encode()).hexdigest()[:10]
    cache_file = PROMPT_CACHE / f"{dataset}-{n}-{min_tokens}-{max_tokens}-{seed}-{tokenizer_key}.json"
    if cache and cache_file.exists():
        return json.loads(cache_file.read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.model_max_length = sys.maxsize  # whole files are tokenized before they are cut
    if dataset == "code":
        ids = code_prompts(tokenizer, n, min_tokens, max_tokens, seed)
    elif dataset == "random":
        ids = random_prompts(tokenizer.vocab_size, n, min_tokens, max_tokens, seed)
    else:
        raise ValueError(f"dataset must be code or random, got {dataset!r}")
    prompts = [tokenizer.decode(p, skip_special_tokens=True) for p in ids]
    if cache:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(prompts))
    return prompts


def wait_for(url: str, timeout: float) -> None:
    """Until `url` answers (a server's health endpoint); the last error after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


class StreamingClient:
    """One gRPC channel; one bidirectional stream per request, closed after its final response."""

    def __init__(self, url: str, model: str = "llm", timeout: float = 600.0):
        import tritonclient.grpc.aio as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.model = model
        self.timeout = timeout
        self.batched = False  # the model has a batch dimension (max_batch_size > 0)
        self.single_response = False  # neither decoupled nor an ensemble: one response, final
        self.input_names: set[str] = set(INPUT_TYPES)

    async def connect(self) -> None:
        config = (await self.client.get_model_config(self.model, as_json=True))["config"]
        self.batched = int(config.get("max_batch_size", 0)) > 0
        self.input_names = {i["name"] for i in config.get("input", [])}
        decoupled = config.get("model_transaction_policy", {}).get("decoupled", False)
        self.single_response = not decoupled and config.get("platform") != "ensemble"

    async def close(self) -> None:
        await self.client.close()

    def inputs(self, prompt: str, workload: Workload, index: int) -> list:
        import tritonclient.grpc as grpcclient

        values = request_inputs(
            prompt, stream=True, max_tokens=workload.output_tokens, ignore_eos=True,
            temperature=workload.temperature,
            seed=workload.seed + index if workload.temperature > 0 else None,
            return_finish_reason=True, return_num_input_tokens=True, return_num_output_tokens=True,
        )
        tensors = []
        for name, value in values.items():
            if name not in self.input_names:
                continue
            datatype, dtype = INPUT_TYPES[name]
            data = str(value).encode("utf-8") if dtype is np.object_ else value
            array = np.array([[data]] if self.batched else [data], dtype=dtype)
            tensor = grpcclient.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return tensors

    async def send(self, prompt: str, workload: Workload, index: int) -> RequestRecord:
        inputs = self.inputs(prompt, workload, index)
        record = RequestRecord(start=time.perf_counter())
        done = asyncio.Event()

        async def requests():
            yield {"model_name": self.model, "inputs": inputs}
            await done.wait()  # keep the stream open until the last response

        responses = self.client.stream_infer(requests())
        try:
            await asyncio.wait_for(self._receive(responses, record), self.timeout)
        except asyncio.TimeoutError:
            record.error = f"no final response within {self.timeout} s"
            responses.cancel()
        except Exception as e:  # a broken stream; the run goes on
            record.error = _short(e)
        finally:
            done.set()
        return record

    async def _receive(self, responses, record: RequestRecord) -> None:
        async for result, error in responses:
            now = time.perf_counter()
            if error is not None:
                record.error = _short(error)
                return
            outputs = {
                name: _scalar(result.as_numpy(name))
                for name in ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens")
            }
            new = outputs["num_output_tokens"]  # this response's tokens (vllm_backend's convention)
            if new is None:  # the model does not count: one token per response with text
                new = bool(outputs["text_output"])
            if int(new) > 0:
                record.chunk_times.append(now)
                record.chunk_tokens.append(int(new))
            if outputs["num_input_tokens"] is not None:
                record.num_input_tokens = int(outputs["num_input_tokens"])
            final = result.get_response().parameters.get("triton_final_response")
            finished = outputs["finish_reason"] not in (None, "", "None")  # "None": more to come
            if finished or self.single_response or (final is not None and final.bool_param):
                return
        if not record.chunk_times:
            record.error = "the stream ended without a response"


def _scalar(array):
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _short(error: object) -> str:
    message = error.message() if hasattr(error, "message") else str(error)
    return (message or type(error).__name__)[:MAX_ERROR_CHARS]


# -- load shapes -------------------------------------------------------------------------------------
async def run_at_rate(client: StreamingClient, workload: Workload, rate: float, progress=None) -> list[RequestRecord]:
    """Poisson arrivals: exponential gaps of mean 1/rate (all at once when rate is inf)."""
    rng = np.random.default_rng(workload.seed)
    tasks = []
    for i, prompt in enumerate(workload.prompts):
        tasks.append(asyncio.create_task(_tracked(client.send(prompt, workload, i), progress)))
        if math.isfinite(rate) and i + 1 < len(workload.prompts):
            await asyncio.sleep(rng.exponential(1.0 / rate))
    return list(await asyncio.gather(*tasks))


async def run_at_concurrency(client: StreamingClient, workload: Workload, concurrency: int, progress=None) -> list[RequestRecord]:
    """`concurrency` requests in flight at all times until the prompts run out."""
    pending = iter(enumerate(workload.prompts))
    records: list[RequestRecord] = []

    async def user():
        for i, prompt in pending:
            records.append(await _tracked(client.send(prompt, workload, i), progress))

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return records


async def _tracked(coroutine, progress):
    record = await coroutine
    if progress is not None:
        progress.update(1)
    return record


async def run_point(
    url: str, model: str, workload: Workload, slo: SLO, rate: float | None = None,
    concurrency: int | None = None, warmup: int = 1, timeout: float = 600.0, label: str = "",
) -> dict:
    """One load point (a rate or a concurrency): its summary, with the load and workload in it."""
    from tqdm import tqdm

    client = StreamingClient(url, model, timeout)
    try:
        await client.connect()
        warm = Workload(workload.prompts[:warmup], workload.output_tokens, workload.temperature)
        await run_at_concurrency(client, warm, max(warmup, 1))
        load = f"rate {rate:g}/s" if rate is not None else f"concurrency {concurrency}"
        with tqdm(total=len(workload.prompts), desc=f"{label}{load}", unit="req", leave=False) as bar:
            if rate is not None:
                records = await run_at_rate(client, workload, rate, bar)
            else:
                records = await run_at_concurrency(client, workload, concurrency, bar)
    finally:
        await client.close()
    summary = summarize(records, slo)
    workload_info = dict(num_prompts=len(workload.prompts), output_tokens=workload.output_tokens,
                         temperature=workload.temperature)
    return dict(model=model, request_rate=rate, concurrency=concurrency, **workload_info, **summary)


def requests_for(args, rate: float | None = None, concurrency: int | None = None) -> int:
    """Prompts per point: --num-prompts, or rate x --duration for a rate point when given;
    at least two per concurrent user."""
    n = args.num_prompts
    if rate is not None and args.duration and math.isfinite(rate):
        n = max(args.min_prompts, round(rate * args.duration))
    if concurrency is not None:
        n = max(n, 2 * concurrency)
    return n


def run_benchmark(args, url: str, model: str, prompts: list[str], label: str = "") -> list[dict]:
    """Every rate, then every concurrency of `args` against one server."""
    slo = SLO(ttft=args.slo_ttft, tpot=args.slo_tpot)
    loads = [(r, None) for r in args.request_rates] + [(None, c) for c in args.concurrencies]
    points = []
    for rate, concurrency in loads:
        n = requests_for(args, rate, concurrency)
        workload = Workload((prompts * (n // len(prompts) + 1))[:n], args.output_tokens,
                            args.temperature, args.seed)
        point = asyncio.run(run_point(url, model, workload, slo, rate, concurrency,
                                      args.warmup, args.request_timeout, label))
        points.append(point)
        print(format_point(label, point), flush=True)
    return points


def format_point(label: str, p: dict) -> str:
    load = f"rate {p['request_rate']:g}/s" if p["request_rate"] is not None else f"conc {p['concurrency']}"
    ms = lambda stats, key: f"{1000 * stats[key]:.0f}" if stats[key] is not None else "-"  # noqa: E731
    return (
        f"{label}{load}: {p['completed']}/{p['num_requests']} ok, {p['request_throughput']:.2f} req/s, "
        f"{p['output_throughput']:.0f} tok/s, TTFT p50/p99 {ms(p['ttft_s'], 'p50')}/{ms(p['ttft_s'], 'p99')} ms, "
        f"TPOT p50/p99 {ms(p['tpot_s'], 'p50')}/{ms(p['tpot_s'], 'p99')} ms, "
        f"goodput {p['goodput']:.2f} req/s ({100 * p['slo_attainment']:.0f}% in SLO)"
    )


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """Workload, load and SLO options (perf/bench_serving.py, perf/sweep_serving.py)."""
    p.add_argument("--dataset", choices=("code", "random"), default="code")
    p.add_argument("--tokenizer", default=str(DEFAULT_TARGET))
    p.add_argument("--num-prompts", type=int, default=64, help="requests per load point")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals per rate point: requests = rate x this (overrides --num-prompts)")
    p.add_argument("--min-prompts", type=int, default=16, help="fewest requests per rate point with --duration")
    p.add_argument("--input-tokens", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    p.add_argument("--output-tokens", type=int, default=32, help="generated per request (ignore_eos)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                   help=f"build the prompts afresh instead of reading {PROMPT_CACHE.relative_to(REPO_ROOT)}/")
    p.add_argument("--request-rates", type=float, nargs="*", default=[],
                   help="Poisson arrival rates in requests/s (inf: all at once)")
    p.add_argument("--concurrencies", type=int, nargs="*", default=[])
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    p.add_argument("--warmup", type=int, default=2, help="requests sent before each point, not measured")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")

