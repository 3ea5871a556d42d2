"""Stopping `llm` requests on one and two llm_engine instances: latency, KV release, balance.

One server per configuration (llm_engine instance_group count 1, then count 2, KIND_CPU, one torch
thread each), on a copy of the model repository in a temporary directory. Against each:
  stop     K long streams (raw tritonclient gRPC, one stream and a unique request id each,
           ignore_eos, greedy) run until each has a few tokens; then, one after the other, a stop
           request (`abort_request_id` only) goes on each stream. Timed: stop sent -> that
           request's final response, and last stop sent -> /metrics (polled every 10 ms) showing
           no request running and every KV block free on every instance. The per-instance
           running counts just before the stops say where the requests were.
  cancel   the same K streams, short, left with `stop_stream(cancel_requests=True)` and no stop
           request; the engine's finish-reason counters then say whether it saw the cancellation
           (abort) or generated to max_tokens (length).
  balance  (count 2 only) 64 equal-size short requests at concurrency 8 (client.stream.complete);
           each instance's share of the requests finished.

    python -m perf.bench_cancel
    python -m perf.bench_cancel --requests 16 --max-tokens 1500 --cancel-max-tokens 32
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from client.stream import INPUT_TYPES, complete, new_abort_key, stop_inputs
from perf.serving_load import load_prompts
from serving.launch.launcher import DEFAULT_MODEL_REPOSITORY, free_ports, start_server
from serving.launch.repository_variants import make_repository

PROMPT_TOKENS, FIRST_TOKENS, POLL_S = 32, 3, 0.01
FINISHED, RUNNING = "specserve_request_success_total", "specserve_num_requests_running"


def start(count: int, workdir: Path):
    overrides = {"llm_engine": {"num_threads": "1"}}
    repository = make_repository(DEFAULT_MODEL_REPOSITORY, workdir / f"count{count}", overrides)
    config = repository / "llm_engine" / "config.pbtxt"
    group = f"instance_group [ {{ count: {count}, kind: KIND_CPU }} ]"
    text, n = re.subn(r"^instance_group \[.*\]$", group, config.read_text(), flags=re.M)
    assert n == 1, f"no one-line instance_group in {config}"
    config.write_text(text)
    http_port, grpc_port, metrics_port = free_ports(3)
    return start_server(repository, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                        log_file=workdir / f"count{count}.log", log_level="warning", ready_timeout=600)


def scrape(url: str) -> dict[tuple[str, str, str], float]:
    """(metric, instance, finish_reason) -> value, for every specserve sample."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for name, labels, value in re.findall(r"^(specserve_\w+)\{([^}]*)\} (\S+)$", text, re.M):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        samples[(name, label.get("model_instance", ""), label.get("finish_reason", ""))] = float(value)
    return samples


def per_instance(samples: dict, name: str, reason: str | None = None) -> dict[str, float]:
    """instance -> value of `name`, summed over finish reasons unless one is given."""
    values: dict[str, float] = {}
    for (n, instance, r), v in sorted(samples.items()):
        if n == name and reason in (None, r):
            values[instance] = values.get(instance, 0.0) + v
    return values


def total(samples: dict, name: str, reason: str | None = None) -> float:
    return sum(per_instance(samples, name, reason).values())


def idle(samples: dict) -> bool:
    """No request running and every KV block free, on every instance."""
    free, size = (per_instance(samples, f"specserve_kv_cache_{k}_blocks") for k in ("free", "total"))
    return bool(size) and total(samples, RUNNING) == 0 and free == size


def wait_for(url: str, condition, timeout: float) -> dict:
    deadline = time.perf_counter() + timeout
    while not condition(samples := scrape(url)) and time.perf_counter() < deadline:
        time.sleep(POLL_S)
    return samples


def tensor(name: str, value) -> grpcclient.InferInput:
    datatype, dtype = INPUT_TYPES.get(name, ("BYTES", np.object_))
    t = grpcclient.InferInput(name, [1], datatype)
    t.set_data_from_numpy(np.array([value.encode() if isinstance(value, str) else value], dtype=dtype))
    return t


class Stream:
    """One streaming `llm` request on a gRPC stream of its own, sent with a unique request id."""

    def __init__(self, url: str, prompt: str, max_tokens: int):
        self.request_id, self.responses, self.reason, self.final_at = uuid.uuid4().hex, 0, None, float("nan")
        self.abort_key = new_abort_key()
        self.done = threading.Event()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_response)
        values = dict(text_input=prompt, stream=True, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                      return_finish_reason=True, abort_key=self.abort_key)
        self.client.async_stream_infer("llm", [tensor(k, v) for k, v in values.items()],
                                       request_id=self.request_id, enable_empty_final_response=True)

    def _on_response(self, result, error) -> None:
        now = time.perf_counter()
        if error is not None:
            self.reason = self.reason or f"error: {error}"
            return self.done.set()
        response = result.get_response()
        if response.id != self.request_id:
            return  # the stop request's own empty response
        text, reason = result.as_numpy("text_output"), result.as_numpy("finish_reason")
        self.responses += bool(text is not None and text.size and text.reshape(-1)[0])  # >= 1 token each
        reason = reason.reshape(-1)[0].decode() if reason is not None and reason.size else ""
        self.reason = reason if reason not in ("", "None") else self.reason
        if response.parameters["triton_final_response"].bool_param:
            self.final_at = now
            self.done.set()

    def stop(self) -> float:
        """Send the stop request on this stream; returns when it was sent."""
        sent = time.perf_counter()
        stop = stop_inputs(self.request_id, self.abort_key)
        self.client.async_stream_infer("llm", [tensor(k, v) for k, v in stop.items()],
                                       request_id=f"{self.request_id}-stop", enable_empty_final_response=True)
        return sent

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def open_streams(url: str, prompts: list[str], max_tokens: int) -> list[Stream]:
    """The streams, once each has had FIRST_TOKENS responses with text."""
    streams, deadline = [Stream(url, p, max_tokens) for p in prompts], time.perf_counter() + 60
    while any(s.responses < FIRST_TOKENS for s in streams):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"responses per stream after 60 s: {[s.responses for s in streams]}")
        time.sleep(POLL_S)
    return streams


def stop_latency(handle, prompts: list[str], max_tokens: int) -> dict:
    before = scrape(handle.metrics_url)
    streams = open_streams(handle.grpc_url, prompts, max_tokens)
    held = wait_for(handle.metrics_url, lambda s: total(s, RUNNING) == len(streams), 5.0)
    latencies, settle = [], float("nan")
    for i, s in enumerate(streams):
        sent = s.stop()
        if i == len(streams) - 1:
            freed = wait_for(handle.metrics_url, idle, 30.0)
            settle = (time.perf_counter() - sent) * 1e3 if idle(freed) else settle
        s.done.wait(30.0)
        latencies.append((s.final_at - sent) * 1e3)
        s.close()
    aborts = total(scrape(handle.metrics_url), FINISHED, "abort") - total(before, FINISHED, "abort")
    return {"held": per_instance(held, RUNNING), "latencies": np.array(latencies), "settle": settle,
            "reasons": [str(s.reason) for s in streams], "aborts": aborts}


def cancel_without_stop(handle, prompts: list[str], max_tokens: int) -> dict:
    before = scrape(handle.metrics_url)
    streams = open_streams(handle.grpc_url, prompts, max_tokens)
    cancelled, unfinished = time.perf_counter(), sum(not s.done.is_set() for s in streams)
    for s in streams:
        s.close(cancel=True)
    done = lambda s: total(s, FINISHED) - total(before, FINISHED) >= len(prompts) and idle(s)  # noqa: E731
    after = wait_for(handle.metrics_url, done, 300.0)
    delta = lambda name, reason=None: total(after, name, reason) - total(before, name, reason)  # noqa: E731
    return {"unfinished": unfinished, "abort": delta(FINISHED, "abort"), "length": delta(FINISHED, "length"),
            "tokens": delta("specserve_generation_tokens_total"), "idle_s": time.perf_counter() - cancelled}


def balance(handle, prompts: list[str], concurrency: int = 8) -> dict[str, float]:
    """instance -> requests it finished, of `prompts` sent `concurrency` at a time."""
    before = per_instance(scrape(handle.metrics_url), FINISHED)
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda p: complete(handle.grpc_url, p, max_tokens=16, temperature=0.0, ignore_eos=True),
                      prompts))
    done = lambda s: total(s, FINISHED) - sum(before.values()) >= len(prompts)  # noqa: E731
    after = per_instance(wait_for(handle.metrics_url, done, 5.0), FINISHED)
    return {instance: v - before.get(instance, 0.0) for instance, v in after.items()}


def measure(count: int, args, prompts: list[str], workdir: Path) -> dict:
    print(f"llm_engine count {count}: starting the server", file=sys.stderr, flush=True)
    handle = start(count, workdir)
    try:
        return {"count": count, "stop": stop_latency(handle, prompts[:args.requests], args.max_tokens),
                "cancel": cancel_without_stop(handle, prompts[:args.requests], args.cancel_max_tokens),
                "balance": balance(handle, prompts[:64]) if count == 2 else None}
    except Exception:
        print(handle.log_tail(), file=sys.stderr)
        raise
    finally:
        handle.stop()


def tables(results: list[dict], args) -> str:
    ms = lambda a, q: f"{np.nanpercentile(a, q):.0f}"  # noqa: E731
    lines = [f"`python -m perf.bench_cancel --requests {args.requests} --max-tokens {args.max_tokens} "
             f"--cancel-max-tokens {args.cancel_max_tokens}`: llm_engine KIND_CPU, num_threads 1, "
             f"{os.cpu_count()} CPU cores; {args.requests} streams of {PROMPT_TOKENS}-token random prompts, "
             f"temperature 0, ignore_eos, stopped one by one after >= {FIRST_TOKENS} tokens each", "",
             "| instances | requests held per instance | finish reasons (client) | abort counter + "
             "| stop -> final response p50 / p99 / max ms | last stop -> all idle, KV free ms |",
             "|---|---|---|---|---|---|"]
    for r in results:
        st = r["stop"]
        held = ", ".join(f"{k} {v:.0f}" for k, v in st["held"].items())
        reasons = ", ".join(f"{x} {st['reasons'].count(x)}" for x in sorted(set(st["reasons"])))
        lines.append(f"| {r['count']} | {held} | {reasons} | {st['aborts']:.0f} | {ms(st['latencies'], 50)} / "
                     f"{ms(st['latencies'], 99)} / {ms(st['latencies'], 100)} | {st['settle']:.0f} |")
    lines += ["", f"No stop request: {args.requests} streams, max_tokens {args.cancel_max_tokens}, each left with "
              f"`stop_stream(cancel_requests=True)` after >= {FIRST_TOKENS} tokens", "",
              "| instances | unfinished at cancel | finished abort | finished length | tokens generated "
              "| cancel -> engine idle s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['count']} | {c['unfinished']} | {c['abort']:.0f} | {c['length']:.0f} | {c['tokens']:.0f} "
              f"| {c['idle_s']:.1f} |" for r in results for c in [r["cancel"]]]
    for r in (r for r in results if r["balance"]):
        n = sum(r["balance"].values()) or 1.0
        lines += ["", f"Balance, {r['count']} instances: 64 requests of {PROMPT_TOKENS} random prompt tokens, "
                  "max_tokens 16, concurrency 8 (client.stream.complete)", "",
                  "| instance | requests finished | share |", "|---|---|---|"]
        lines += [f"| {k} | {v:.0f} | {v / n:.0%} |" for k, v in r["balance"].items()]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8, help="K: streams stopped per configuration")
    p.add_argument("--max-tokens", type=int, default=1000, help="of the streams that are stopped")
    p.add_argument("--cancel-max-tokens", type=int, default=64, help="of the streams cancelled without a stop")
    args = p.parse_args()
    prompts = load_prompts(DEFAULT_MODEL_REPOSITORY / "llm_engine" / "1" / "target", "random",
                           max(args.requests, 64), PROMPT_TOKENS, PROMPT_TOKENS, cache=False)
    with tempfile.TemporaryDirectory() as workdir:
        results = [measure(count, args, prompts, Path(workdir)) for count in (1, 2)]
    print(tables(results, args))


if __name__ == "__main__":
    main()
