"""Nothing that crosses a process or host boundary is pickled: no pickle, no pyzmq pyobj, no
torch.distributed object collective (each pickles) anywhere in the served code."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVED = ("backend", "serving", "client")
FORBIDDEN = re.compile(r"\b(c?[Pp]ickle|cloudpickle|dill|send_pyobj|recv_pyobj|broadcast_object_list|gather_object|"
                       r"scatter_object_list|all_gather_object|send_object_list|recv_object_list)\b")


def test_no_pickle_in_the_served_code():
    sources = [p for d in SERVED for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(sources) > 20  # the tree is where this test thinks it is
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sources
             for i, line in enumerate(p.read_text().splitlines(), 1) if FORBIDDEN.search(line)]
    assert found == []


def test_the_pattern_catches_each_way_in():
    for line in ("import pickle", "socket.recv_pyobj()", "dist.broadcast_object_list(box)",
                 "dist.gather_object(x, None)", "from cloudpickle import loads"):
        assert FORBIDDEN.search(line), line
