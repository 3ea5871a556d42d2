"""Server variants against the baseline: the headline numbers, their ratios and the table."""
from __future__ import annotations

import pytest

from perf.serving_comparison import BASELINE, compare, markdown_table


def _point(rate, attainment, throughput, p99_ttft, output_tps, concurrency=None):
    return dict(request_rate=rate, concurrency=concurrency, slo_attainment=attainment,
                request_throughput=throughput, offered_rate=rate, goodput=attainment * throughput,
                output_throughput=output_tps, ttft_s=dict(p99=p99_ttft))


def test_compare_reports_ratios_to_the_baseline():
    results = {
        "engine": [_point(1, 1.0, 1.0, 0.1, 32), _point(2, 0.95, 2.0, 0.2, 64), _point(4, 0.5, 3.0, 4.0, 96),
                   _point(None, 0.0, 5.0, 1.0, 160, concurrency=16)],
        BASELINE: [_point(1, 0.9, 1.0, 1.0, 32), _point(2, 0.3, 1.0, 8.0, 32), _point(4, 0.0, 1.0, 20.0, 32)],
    }
    table = compare(results, min_attainment=0.9)
    assert table["baseline_saturation_rate"] == 2  # 1.0 req/s completed of 2 offered
    engine = table["variants"]["engine"]
    assert engine["sustainable_rate"] == 2 and table["variants"][BASELINE]["sustainable_rate"] == 1
    assert engine["sustainable_rate_vs_baseline"] == pytest.approx(2.0)
    assert engine["p99_ttft_at_baseline_saturation"] == pytest.approx(0.2)
    assert engine["p99_ttft_lower_than_baseline"] == pytest.approx(40.0)
    assert engine["peak_output_throughput"] == 160
    assert engine["output_throughput_vs_baseline"] == pytest.approx(5.0)
    text = markdown_table(table, "TTFT < 1 s")
    assert "| engine | 2 | 2.00x | 200 ms | 40.00x | 160 | 5.00x |" in text


def test_a_baseline_that_never_met_the_slo_gives_a_lower_bound():
    results = {"engine": [_point(0.5, 1.0, 0.5, 0.1, 16), _point(2, 1.0, 2.0, 0.2, 64)],
               BASELINE: [_point(0.5, 0.5, 0.5, 1.5, 16), _point(2, 0.0, 1.0, 9.0, 32)]}
    table = compare(results, min_attainment=0.9)
    engine = table["variants"]["engine"]
    assert engine["sustainable_rate_vs_baseline"] is None
    assert engine["sustainable_rate_vs_baseline_more_than"] == pytest.approx(4.0)  # below 0.5 req/s
    assert "| engine | 2 | > 4.0x | 200 ms | 45.00x |" in markdown_table(table, "TTFT < 1 s")
