"""Model repositories made from another for a run: the same models with some engine parameters
changed (a benchmark's variant of a server, a test's), and extra `llm` arms over differently
configured engines (an A/B experiment's). Configs are rewritten, version directories linked.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path


def override_parameters(config: str, values: dict[str, str]) -> str:
    """config.pbtxt text with each `parameters` entry in `values` set, appended when missing."""
    for key, value in values.items():
        entry = re.compile(r'(\{\s*key:\s*"' + re.escape(key) + r'"\s*,\s*value:\s*\{\s*string_value:\s*")[^"]*(")')
        if entry.search(config):
            config = entry.sub(lambda m: m.group(1) + value + m.group(2), config)
            continue
        block = re.search(r"^parameters\s*\[(.*?)^\]", config, re.S | re.M)
        line = f'  {{ key: "{key}", value: {{ string_value: "{value}" }} }}'
        if block is None:
            config += f"\nparameters [\n{line}\n]\n"
        else:
            body = block.group(1).rstrip()
            config = config[: block.start(1)] + f"{body},\n{line}\n" + config[block.end(1):]
    return config


def make_repository(source: Path, dest: Path, overrides: dict[str, dict[str, str]]) -> Path:
    """A copy of `source` in `dest`: configs rewritten with `overrides`, version dirs linked."""
    for model_dir in sorted(p for p in source.iterdir() if (p / "config.pbtxt").exists()):
        target = dest / model_dir.name
        target.mkdir(parents=True)
        config = (model_dir / "config.pbtxt").read_text()
        (target / "config.pbtxt").write_text(override_parameters(config, overrides.get(model_dir.name, {})))
        for version in (p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()):
            (target / version.name).symlink_to(version.resolve(), target_is_directory=True)
    return dest


def add_variant(repository: Path, suffix: str, parameters: dict[str, str]) -> None:
    """`llm_<suffix>` in `repository`: `llm` over `llm_engine_<suffix>`, a copy of llm_engine with
    some of its parameters changed (an A/B experiment's arm over another engine configuration)."""
    llm = (repository / "llm" / "config.pbtxt").read_text()
    engine = (repository / "llm_engine" / "config.pbtxt").read_text()
    llm = llm.replace('name: "llm"', f'name: "llm_{suffix}"', 1).replace('"llm_engine"', f'"llm_engine_{suffix}"')
    engine = override_parameters(engine.replace('name: "llm_engine"', f'name: "llm_engine_{suffix}"', 1), parameters)
    for name, config in ((f"llm_{suffix}", llm), (f"llm_engine_{suffix}", engine)):
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(config)
    for source in (repository / "llm_engine" / "1").iterdir():
        if source.suffix == ".py":
            shutil.copy(source, repository / f"llm_engine_{suffix}" / "1" / source.name)
        elif source.is_dir() and not (repository / f"llm_engine_{suffix}" / "1" / source.name).exists():
            (repository / f"llm_engine_{suffix}" / "1" / source.name).symlink_to(source.resolve(), target_is_directory=True)
