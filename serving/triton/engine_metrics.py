"""Prometheus metrics of the engine, through Triton's custom metrics API (pb_utils.MetricFamily).

They appear on Triton's metrics port beside Triton's own, labelled with the model and version.
Engine totals (EngineStats) are cumulative; Triton counters only increment, so each refresh adds
the difference since the previous one.
"""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

# Seconds; the same spirit as vLLM's buckets, trimmed to what a CPU or one GPU sees.
TTFT_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0]
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0]

GAUGES = {  # EngineStats field -> (metric name, help)
    "num_running": ("specserve_num_requests_running", "Requests in the running batch"),
    "num_waiting": ("specserve_num_requests_waiting", "Requests waiting to be scheduled"),
    "kv_cache_usage": ("specserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1)"),
    "num_free_blocks": ("specserve_kv_cache_free_blocks", "KV cache blocks free (cached ones included)"),
    "num_total_blocks": ("specserve_kv_cache_total_blocks", "KV cache blocks in the pool"),
}
COUNTERS = {  # EngineStats field -> (metric name, help)
    "prompt_tokens_total": ("specserve_prompt_tokens_total", "Prompt tokens admitted"),
    "generation_tokens_total": ("specserve_generation_tokens_total", "Tokens generated"),
    "num_preemptions_total": ("specserve_num_preemptions_total", "Requests preempted (recomputed later)"),
    "prefix_cache_hit_tokens_total": (
        "specserve_prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache",
    ),
    "prefix_cache_query_tokens_total": (
        "specserve_prefix_cache_query_tokens_total", "Prompt tokens looked up in the prefix cache",
    ),
    "spec_draft_tokens_total": ("specserve_spec_decode_draft_tokens_total", "Draft tokens proposed"),
    "spec_accepted_tokens_total": (
        "specserve_spec_decode_accepted_tokens_total", "Draft tokens accepted by the target",
    ),
}
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self._families = []  # kept alive: a family's metrics vanish with it
        self.gauges = {
            field: self._family(name, help, pb_utils.MetricFamily.GAUGE).Metric(labels=labels)
            for field, (name, help) in GAUGES.items()
        }
        self.counters = {
            field: self._family(name, help, pb_utils.MetricFamily.COUNTER).Metric(labels=labels)
            for field, (name, help) in COUNTERS.items()
        }
        self._reported = {field: 0 for field in COUNTERS}  # counter totals already added
        self._gauge_values: dict[str, float] = {}  # each update is a round trip to the server
        requests = self._family(
            "specserve_request_success_total", "Requests finished, by finish reason",
            pb_utils.MetricFamily.COUNTER,
        )
        self.finished = {
            reason: requests.Metric(labels=labels | {"finish_reason": reason}) for reason in FINISH_REASONS
        }
        self.time_to_first_token = self._histogram(
            "specserve_time_to_first_token_seconds", "Arrival to first generated token", TTFT_BUCKETS
        )
        self.inter_token_latency = self._histogram(
            "specserve_inter_token_latency_seconds", "Time between generated tokens", ITL_BUCKETS
        )
        self.e2e_latency = self._histogram(
            "specserve_e2e_request_latency_seconds", "Arrival to last response", E2E_BUCKETS
        )
        self.queue_time = self._histogram(
            "specserve_request_queue_time_seconds", "Arrival in the engine to first scheduled", TTFT_BUCKETS
        )

    def _family(self, name: str, help: str, kind):
        family = pb_utils.MetricFamily(name=name, description=help, kind=kind)
        self._families.append(family)
        return family

    def _histogram(self, name: str, help: str, buckets: list[float]):
        family = self._family(name, help, pb_utils.MetricFamily.HISTOGRAM)
        return family.Metric(labels=self.labels, buckets=buckets)

    def refresh(self, stats) -> None:
        """Copy an EngineStats snapshot into the gauges and counters."""
        for field, gauge in self.gauges.items():
            value = float(getattr(stats, field))
            if self._gauge_values.get(field) != value:
                gauge.set(value)
                self._gauge_values[field] = value
        for field, counter in self.counters.items():
            total = getattr(stats, field)
            if total > self._reported[field]:
                counter.increment(float(total - self._reported[field]))
                self._reported[field] = total

    def request_finished(self, finish_reason: str, e2e_seconds: float, queue_seconds: float | None) -> None:
        """A request's last output: e2e from the adapter's clock, queue time from the engine's
        own timestamps of the request (None: it never ran)."""
        if finish_reason in self.finished:
            self.finished[finish_reason].increment(1.0)
        self.e2e_latency.observe(e2e_seconds)
        if queue_seconds is not None:
            self.queue_time.observe(queue_seconds)
