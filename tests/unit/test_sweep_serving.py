"""The serving sweep's repository generation and comparison table (no server started)."""
from __future__ import annotations

import pytest

from perf.sweep_serving import BASELINE, compare, make_repository, markdown_table, override_parameters

CONFIG = """name: "m"
parameters [
  { key: "model", value: { string_value: "1/target" } },
  # a comment
  { key: "speculative_method", value: { string_value: "none" } }
]

instance_group [ { count: 1, kind: KIND_MODEL } ]
"""


def test_override_sets_existing_and_appends_new_parameters():
    out = override_parameters(CONFIG, {"speculative_method": "draft", "draft_model": "1/draft"})
    assert '{ key: "speculative_method", value: { string_value: "draft" } }' in out
    assert '"none"' not in out
    assert out.index('key: "draft_model"') < out.index("instance_group")
    assert '{ key: "draft_model", value: { string_value: "1/draft" } }\n]' in out
    assert '  { key: "speculative_method", value: { string_value: "draft" } },\n' in out
    assert override_parameters(CONFIG, {}) == CONFIG


def test_override_adds_a_parameters_block_when_there_is_none():
    out = override_parameters('name: "m"\n', {"num_threads": "1"})
    assert 'parameters [\n  { key: "num_threads", value: { string_value: "1" } }\n]' in out


def test_make_repository_links_versions_and_rewrites_configs(tmp_path):
    source = tmp_path / "src"
    (source / "m" / "1").mkdir(parents=True)
    (source / "m" / "1" / "model.py").write_text("# model")
    (source / "m" / "config.pbtxt").write_text(CONFIG)
    (source / "not_a_model").mkdir()
    dest = make_repository(source, tmp_path / "dest", {"m": {"model": "/abs/target"}})
    assert sorted(p.name for p in dest.iterdir()) == ["m"]
    assert (dest / "m" / "1").is_symlink()
    assert (dest / "m" / "1" / "model.py").read_text() == "# model"
    assert 'string_value: "/abs/target"' in (dest / "m" / "config.pbtxt").read_text()
    assert (source / "m" / "config.pbtxt").read_text() == CONFIG


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
