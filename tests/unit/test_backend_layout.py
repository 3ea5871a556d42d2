"""backend/ is a stack of sub-packages, each importing only those below it (type-only imports
included), so that none of them sits in an import circle:

    process      the engine core in its own process, its client, their messages
    engine       engine.py, engine_setup.py, engine_loop.py and engine_driver.py (the step, its
                 start-up stages, the thread that drives it, what a server drives an engine through)
    parallel     the ranks: handshake, wire format, workers, other nodes
    speculative  speculative decoding: speculator, proposers, control
    model        the model, its loader and runner, the step inputs
    sample       sampling and verification on the device
    core         requests, scheduler, KV blocks, output processing
    base         backend/*.py: config, errors, parameters, device and host-transfer helpers
"""
from __future__ import annotations

import re
from pathlib import Path

BACKEND = Path(__file__).resolve().parents[2] / "backend"
FLOORS = ["base", "core", "sample", "model", "speculative", "parallel", "engine", "process"]
ENGINE_MODULES = {"engine", "engine_setup", "engine_loop", "engine_driver"}
IMPORT = re.compile(r"^\s*(?:from|import) backend((?:\.\w+)*)", re.M)


def floor_of(parts: list[str]) -> str:
    """parts: the dotted path below backend (["core", "request"], ["engine"], ["errors"])."""
    if len(parts) >= 2:
        return parts[0]
    return "engine" if parts and parts[0] in ENGINE_MODULES else "base"


def imports() -> list[tuple[str, str, str]]:
    """(importing file, its floor, the floor it imports) for every backend import in backend/."""
    found = []
    for path in sorted(BACKEND.rglob("*.py")):
        relative = path.relative_to(BACKEND).with_suffix("").parts
        own = floor_of([p for p in relative if p != "__init__"])
        for dotted in IMPORT.findall(path.read_text()):
            found.append((str(path.relative_to(BACKEND)), own, floor_of(dotted.strip(".").split("."))))
    return found


def test_every_module_is_on_a_known_floor():
    packages = {p.name for p in BACKEND.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(FLOORS) - {"base", "engine"}


def test_no_import_runs_up_a_floor():
    upward = [(f, own, target) for f, own, target in imports() if FLOORS.index(target) > FLOORS.index(own)]
    assert upward == []
    assert len(imports()) > 100  # the check reads the real imports
