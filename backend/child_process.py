"""Starting the engine's helper processes: the engine core, worker ranks."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid


def start_module(module: str, *args: str) -> subprocess.Popen:
    """`python -m module args...` on the Python the launcher names in SPECSERVE_PYTHON (the Triton
    stub that hosts an engine is no Python executable), else on this one."""
    python = os.environ.get("SPECSERVE_PYTHON") or sys.executable
    return subprocess.Popen([python, "-m", module, *args])


def unique_path(kind: str) -> str:
    """A file path no other engine on this host uses (IPC sockets, rendezvous): several instances
    share a host."""
    return f"{tempfile.gettempdir()}/specserve-{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
