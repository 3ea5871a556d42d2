"""Starting the engine's helper processes (the engine core, worker ranks) and the private
directory where each engine keeps what they meet at (IPC sockets, the ranks' rendezvous file)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile


def start_module(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m module args...` on the Python the launcher names in SPECSERVE_PYTHON (the Triton
    stub that hosts an engine is no Python executable), else on this one; `env` is added to this
    process's environment (secrets go there, never in argv: a command line is world-readable)."""
    python = os.environ.get("SPECSERVE_PYTHON") or sys.executable
    return subprocess.Popen([python, "-m", module, *args], env=os.environ | env if env else None)


def private_directory(kind: str) -> str:
    """A new directory only this user can enter (0700), its name unpredictable: several engines
    share a host, and no other user may connect to their sockets or rendezvous file."""
    return tempfile.mkdtemp(prefix=f"specserve-{kind}-")


def remove_directory(path: str | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
