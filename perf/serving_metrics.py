"""Serving metrics from client-side timestamps: what a user of a streaming LLM server sees.

Per request (all times in seconds, from the same monotonic clock):
- time to first token (TTFT): first response with text minus the time the request was sent.
- inter-token latency (ITL): the gap between two responses, spread evenly over the tokens of the
  later one (a response carries several tokens when speculation accepts drafts), so there is one
  value per token after the first response; the server's `specserve_inter_token_latency_seconds`
  is defined the same way. Tokens of the first response have no gap and no ITL.
- time per output token (TPOT): (end-to-end latency - TTFT) / (output tokens - 1), the mean
  decode pace after the first token; None for a single-token output.
- end-to-end latency (E2E): last response minus send time.

Over a run: request and token throughput over the benchmark's duration (first send to last
response), percentiles of each latency (numpy's linear interpolation, as vLLM's `bench serve`),
and goodput under an SLO: requests per second that completed and met every limit (a request
whose TPOT is None meets any TPOT limit). SLO attainment is that count over all requests sent.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    start: float  # when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # arrival of each response with text
    chunk_tokens: list[int] = field(default_factory=list)  # tokens carried by each of those
    num_input_tokens: int = 0
    error: str | None = None  # None: completed

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_tokens)


@dataclass(slots=True)
class SLO:
    ttft: float = 1.0  # seconds
    tpot: float = 0.1  # seconds

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok or time_to_first_token(record) >= self.ttft:
            return False
        tpot = time_per_output_token(record)
        return tpot is None or tpot < self.tpot


def time_to_first_token(record: RequestRecord) -> float:
    return record.chunk_times[0] - record.start


def end_to_end_latency(record: RequestRecord) -> float:
    return record.chunk_times[-1] - record.start


def time_per_output_token(record: RequestRecord) -> float | None:
    if record.num_output_tokens <= 1:
        return None
    decode_time = end_to_end_latency(record) - time_to_first_token(record)
    return decode_time / (record.num_output_tokens - 1)


def inter_token_latencies(record: RequestRecord) -> list[float]:
    itls = []
    for i in range(1, len(record.chunk_times)):
        gap = record.chunk_times[i] - record.chunk_times[i - 1]
        num_tokens = max(record.chunk_tokens[i], 1)
        itls += [gap / num_tokens] * num_tokens
    return itls


def latency_stats(values: list[float], percentiles: tuple[int, ...] = PERCENTILES) -> dict[str, float | None]:
    """mean, std, min, max and p<N> of `values`; every field None when there are none."""
    keys = ["mean", "std", "min", "max", *(f"p{p}" for p in percentiles)]
    if not values:
        return dict.fromkeys(keys)
    a = np.asarray(values, dtype=np.float64)
    stats = dict(mean=a.mean(), std=a.std(), min=a.min(), max=a.max())
    stats |= {f"p{p}": np.percentile(a, p) for p in percentiles}
    return {k: float(v) for k, v in stats.items()}


def benchmark_duration(records: list[RequestRecord]) -> float:
    """First send to the last response of any request (or the last send, if none answered)."""
    starts = [r.start for r in records]
    ends = [r.chunk_times[-1] for r in records if r.chunk_times]
    return max(ends + starts) - min(starts) if records else 0.0


def offered_rate(records: list[RequestRecord]) -> float | None:
    """Requests per second actually sent: (n - 1) gaps over the span of send times."""
    starts = sorted(r.start for r in records)
    if len(starts) < 2 or starts[-1] == starts[0]:
        return None
    return (len(starts) - 1) / (starts[-1] - starts[0])


def summarize(
    records: list[RequestRecord], slo: SLO, duration: float | None = None,
    percentiles: tuple[int, ...] = PERCENTILES,
) -> dict:
    """The run's metrics as a JSON-ready dict; `duration` defaults to `benchmark_duration`."""
    duration = benchmark_duration(records) if duration is None else duration
    done = [r for r in records if r.ok]
    tpots = [t for t in map(time_per_output_token, done) if t is not None]
    num_good = sum(slo.met_by(r) for r in records)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    output_tokens = sum(r.num_output_tokens for r in done)
    input_tokens = sum(r.num_input_tokens for r in done)
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": errors,
        "duration_s": duration,
        "offered_rate": offered_rate(records),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(output_tokens + input_tokens),
        "slo": asdict(slo),
        "goodput": per_second(num_good),
        "slo_attainment": num_good / len(records) if records else 0.0,
        "ttft_s": latency_stats([time_to_first_token(r) for r in done], percentiles),
        "tpot_s": latency_stats(tpots, percentiles),
        "itl_s": latency_stats([x for r in done for x in inter_token_latencies(r)], percentiles),
        "e2e_latency_s": latency_stats([end_to_end_latency(r) for r in done], percentiles),
    }


def sustainable_rate(points: list[dict], min_attainment: float = 0.9) -> float:
    """The highest request rate up to which every swept rate met the SLO for `min_attainment` of
    its requests (DistServe's SLO attainment); 0.0 when the lowest rate already missed.
    `points`: summaries with a `request_rate`."""
    best = 0.0
    for point in sorted(points, key=lambda p: p["request_rate"]):
        if point["slo_attainment"] < min_attainment:
            break
        best = point["request_rate"]
    return best


def saturation_rate(points: list[dict], min_fraction: float = 0.9) -> float | None:
    """The lowest swept rate at which completed requests per second fell below `min_fraction` of
    the rate actually offered (the queue grows instead of draining); None if the server kept up
    at every rate."""
    for point in sorted(points, key=lambda p: p["request_rate"]):
        offered = point["offered_rate"] or point["request_rate"]
        if point["request_throughput"] < min_fraction * offered:
            return point["request_rate"]
    return None
