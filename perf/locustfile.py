"""Locust users that stream completions from `llm` over HTTP server-sent events.

Each user posts a code prompt (cut from held-out standard-library files) to
/v2/models/llm/generate_stream, reads the events as they arrive, then thinks for a moment and
asks again. Besides the request itself (type POST, its response time the end-to-end latency, a
failure for an HTTP error, an error event, a broken stream or a missing final event), each
completed request reports custom events, so the stats, CSV and HTML report carry them:

    TTFT      time to the first event with text (ms)
    ITL       per event after the first: its gap spread over its tokens (ms per token)
    TPOT      (end-to-end - TTFT) / (output tokens - 1) (ms)
    TOKENS/S  output tokens / end-to-end latency; the number in the time columns is tokens per
              second, not ms, and the "size" columns count output tokens

    make locust                                       # 50 users, 2 minutes, against localhost:8000
    python -m locust -f perf/locustfile.py --headless -u 50 -r 10 -t 2m --host http://localhost:8000 \\
        --max-tokens 64 --csv perf/results/locust --html perf/results/locust.html
"""
from __future__ import annotations

import json
import random
import time

from locust import HttpUser, between, events, task

from perf.prompts import DEFAULT_TARGET
from perf.serving_load import load_prompts

ENDPOINT = "/v2/models/{model}/generate_stream"
PROMPTS: list[str] = []
TOTALS = {"requests": 0, "output_tokens": 0, "errors": 0, "first_start": None, "last_end": None}


@events.init_command_line_parser.add_listener
def _arguments(parser) -> None:
    parser.add_argument("--model", default="llm", help="model to stream from")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (ignore_eos)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dataset", choices=("code", "random"), default="code")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-tokens", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))


@events.init.add_listener
def _load_prompts(environment, **_kwargs) -> None:
    options = environment.parsed_options
    PROMPTS.extend(load_prompts(DEFAULT_TARGET, options.dataset, options.num_prompts, *options.input_tokens))


@events.test_stop.add_listener
def _summary(environment, **_kwargs) -> None:
    if TOTALS["first_start"] is None:
        return
    span = TOTALS["last_end"] - TOTALS["first_start"]
    print(
        f"streamed {TOTALS['requests']} completions, {TOTALS['output_tokens']} output tokens in "
        f"{span:.0f} s: {TOTALS['output_tokens'] / span:.1f} output tokens/s, {TOTALS['errors']} errors",
        flush=True,
    )


class StreamingUser(HttpUser):
    wait_time = between(0.5, 2.0)

    @task
    def stream_completion(self) -> None:
        options = self.environment.parsed_options
        body = {
            "text_input": random.choice(PROMPTS), "max_tokens": options.max_tokens,
            "temperature": options.temperature, "ignore_eos": True, "stream": True,
            "return_num_output_tokens": True, "return_finish_reason": True,
        }
        endpoint = ENDPOINT.format(model=options.model)
        start = time.perf_counter()
        TOTALS["first_start"] = TOTALS["first_start"] or time.time()
        chunk_times, chunk_tokens = [], []
        with self.client.post(endpoint, json=body, stream=True, catch_response=True, name=endpoint) as response:
            try:
                error = self._read_events(response, chunk_times, chunk_tokens)
            except Exception as e:  # the connection broke mid-stream
                error = f"stream broken: {type(e).__name__}: {e}"
            if error is not None:
                TOTALS["errors"] += 1
                response.failure(error)
                return
            response.request_meta["response_time"] = 1000 * (chunk_times[-1] - start)  # not to the headers
            response.success()
        TOTALS["last_end"] = time.time()
        self._report(start, chunk_times, chunk_tokens)

    def _read_events(self, response, chunk_times: list[float], chunk_tokens: list[int]) -> str | None:
        """Reads the SSE stream into arrival times and token counts; returns an error or None."""
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {response.text[:200]}"
        finished = False
        for line in response.iter_lines():
            if not line.startswith(b"data:"):
                continue
            now = time.perf_counter()
            event = json.loads(line[len(b"data:"):])
            if "error" in event:
                return f"error event: {str(event['error'])[:200]}"
            new = int(_scalar(event.get("num_output_tokens", 1)))  # this event's tokens
            if new > 0:
                chunk_times.append(now)
                chunk_tokens.append(new)
            finished = finished or _scalar(event.get("finish_reason")) not in (None, "", "None")
        if not finished:
            return "the stream ended without a final event"
        return None

    def _report(self, start: float, chunk_times: list[float], chunk_tokens: list[int]) -> None:
        fire = self.environment.events.request.fire
        name = self.environment.parsed_options.model
        num_tokens = sum(chunk_tokens)
        ttft = chunk_times[0] - start
        e2e = chunk_times[-1] - start
        TOTALS["requests"] += 1
        TOTALS["output_tokens"] += num_tokens
        fire(request_type="TTFT", name=name, response_time=1000 * ttft, response_length=0, exception=None)
        for i in range(1, len(chunk_times)):
            itl = (chunk_times[i] - chunk_times[i - 1]) / chunk_tokens[i]
            fire(request_type="ITL", name=name, response_time=1000 * itl, response_length=chunk_tokens[i], exception=None)
        if num_tokens > 1:
            tpot = (e2e - ttft) / (num_tokens - 1)
            fire(request_type="TPOT", name=name, response_time=1000 * tpot, response_length=0, exception=None)
        fire(request_type="TOKENS/S", name=name, response_time=num_tokens / e2e, response_length=num_tokens, exception=None)


def _scalar(value):
    """An output of shape [1] as one value (the HTTP frontend may send it as a list)."""
    return (value[0] if value else None) if isinstance(value, list) else value
