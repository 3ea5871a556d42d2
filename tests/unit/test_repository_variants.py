"""Model repositories made from another: parameters overridden, version directories linked."""
from __future__ import annotations

from serving.launch.repository_variants import make_repository, override_parameters

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
