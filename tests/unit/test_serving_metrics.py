"""Serving metrics on synthetic timestamps: exact TTFT, TPOT, ITL, percentiles and goodput."""
from __future__ import annotations

import pytest

from perf.serving_metrics import (
    SLO,
    RequestRecord,
    benchmark_duration,
    end_to_end_latency,
    inter_token_latencies,
    latency_stats,
    offered_rate,
    saturation_rate,
    summarize,
    sustainable_rate,
    time_per_output_token,
    time_to_first_token,
)


def record(start: float, times: list[float], tokens: list[int] | None = None, **kw) -> RequestRecord:
    return RequestRecord(start, list(times), tokens if tokens is not None else [1] * len(times), **kw)


def test_request_latencies():
    # sent at 10.0; responses at 10.5 (1 token), 10.6 (1), 10.8 (2: a draft accepted), 11.1 (1)
    r = record(10.0, [10.5, 10.6, 10.8, 11.1], [1, 1, 2, 1])
    assert r.num_output_tokens == 5
    assert time_to_first_token(r) == pytest.approx(0.5)
    assert end_to_end_latency(r) == pytest.approx(1.1)
    assert time_per_output_token(r) == pytest.approx(0.6 / 4)
    # one value per token after the first response; the 0.2 s gap is shared by its two tokens
    assert inter_token_latencies(r) == pytest.approx([0.1, 0.1, 0.1, 0.3])


def test_tokens_of_the_first_response_have_no_inter_token_latency():
    r = record(0.0, [0.4, 0.5], [3, 1])
    assert inter_token_latencies(r) == pytest.approx([0.1])
    assert time_per_output_token(r) == pytest.approx(0.1 / 3)


def test_single_token_and_single_response():
    assert time_per_output_token(record(0.0, [0.3], [1])) is None
    assert inter_token_latencies(record(0.0, [0.3], [1])) == []
    # a non-streaming server: every token in one response, so TTFT is the whole latency
    whole = record(0.0, [2.0], [32])
    assert time_to_first_token(whole) == end_to_end_latency(whole) == 2.0
    assert time_per_output_token(whole) == 0.0


def test_percentiles_interpolate_linearly():
    stats = latency_stats([float(x) for x in range(1, 101)])
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)
    assert (stats["mean"], stats["min"], stats["max"]) == (50.5, 1.0, 100.0)
    assert latency_stats([0.25])["p99"] == 0.25
    assert latency_stats([4.0, 1.0, 3.0, 2.0], percentiles=(25,))["p25"] == pytest.approx(1.75)
    assert set(latency_stats([]).values()) == {None}


def test_slo_limits_are_strict():
    slo = SLO(ttft=1.0, tpot=0.25)
    assert slo.met_by(record(0.0, [0.5, 0.625, 0.75]))  # TPOT 0.125
    assert not slo.met_by(record(0.0, [1.0, 1.125]))  # TTFT exactly at the limit
    assert not slo.met_by(record(0.0, [0.5, 0.75, 1.0]))  # TPOT exactly at the limit
    assert slo.met_by(record(0.0, [0.9], [1]))  # no TPOT: only TTFT counts
    assert not slo.met_by(record(0.0, [0.1, 0.2], error="boom"))
    assert not slo.met_by(record(0.0, []))


def test_summary_counts_throughput_and_goodput():
    records = [
        record(0.0, [0.2, 0.25, 0.3, 0.35], num_input_tokens=10),  # meets the SLO
        record(1.0, [2.5, 2.55, 2.6, 2.65], num_input_tokens=10),  # TTFT 1.5 s
        record(2.0, [2.1, 2.5, 2.9, 3.3], num_input_tokens=10),  # TPOT 0.4 s
        record(3.0, [3.4], [1], num_input_tokens=10),  # one token, meets the SLO
        record(4.0, [], error="INVALID_ARG: max_tokens"),  # failed
    ]
    s = summarize(records, SLO(ttft=1.0, tpot=0.1), duration=10.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["errors"] == {"INVALID_ARG: max_tokens": 1}
    assert s["total_output_tokens"] == 13
    assert s["total_input_tokens"] == 40
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["output_throughput"] == pytest.approx(1.3)
    assert s["total_token_throughput"] == pytest.approx(5.3)
    assert s["goodput"] == pytest.approx(0.2)
    assert s["slo_attainment"] == pytest.approx(0.4)
    assert s["ttft_s"]["max"] == pytest.approx(1.5)
    assert s["tpot_s"]["max"] == pytest.approx(0.4)  # three TPOTs: the one-token request has none
    assert s["tpot_s"]["min"] == pytest.approx(0.05)
    assert s["e2e_latency_s"]["p50"] == pytest.approx((0.4 + 1.3) / 2)
    assert s["offered_rate"] == pytest.approx(1.0)


def test_duration_spans_first_send_to_last_response():
    records = [record(5.0, [5.5, 9.0]), record(6.0, [7.0]), record(8.0, [], error="x")]
    assert benchmark_duration(records) == pytest.approx(4.0)
    assert summarize(records, SLO())["duration_s"] == pytest.approx(4.0)
    assert offered_rate(records) == pytest.approx(2 / 3)
    assert offered_rate(records[:1]) is None


def point(rate: float, attainment: float, throughput: float, offered: float | None = None) -> dict:
    return dict(request_rate=rate, slo_attainment=attainment, request_throughput=throughput,
                offered_rate=offered)


def test_sustainable_rate_stops_at_the_first_rate_that_misses():
    points = [point(4, 0.5, 3.0), point(1, 1.0, 1.0), point(2, 0.92, 2.0), point(8, 0.95, 4.0)]
    assert sustainable_rate(points) == 2  # 8 is not counted: 4 missed before it
    assert sustainable_rate(points, min_attainment=0.95) == 1
    assert sustainable_rate([point(1, 0.2, 1.0)]) == 0.0


def test_saturation_rate_compares_throughput_with_the_offered_rate():
    points = [point(1, 1.0, 0.95, 1.0), point(2, 1.0, 1.7, 1.8), point(4, 0.1, 2.5, 4.1)]
    assert saturation_rate(points) == 4  # 1.7 >= 0.9 x 1.8; 2.5 < 0.9 x 4.1
    assert saturation_rate(points[:2]) is None
    assert saturation_rate([point(2, 1.0, 1.7, None)]) == 2  # no measured offer: the nominal rate
