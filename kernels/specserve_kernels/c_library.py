"""C kernels for x86 CPUs, compiled on first use with the machine's C compiler (as torch.compile's
inductor compiles its own) into a private cache directory, keyed by the source's and the flags'
hash (and torch's version), and loaded with ctypes. They run on the OpenMP runtime torch loaded
(the same libgomp: one pool of threads, not two). Used by kernels/specserve_kernels/int4_cpu.py and
kernels/specserve_kernels/paged_attention_cpu.py; a C++ source (kernels/specserve_kernels/cpu_ops.py's) is compiled by the C++
compiler.

    load(source, flags)         the shared library built from `source` (built now if not cached)
    runs(library, fallback)     whether a kernel's `library()` loads on this CPU (AVX2 or AVX-512)
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import stat
import subprocess
import tempfile
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")


def runs(library: Callable[[], ctypes.CDLL], fallback: str) -> bool:
    """Whether the kernel that `library` loads runs here: an x86 CPU with AVX2, and the library
    built (now, if not cached); where it cannot be built, logs why and what runs instead."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    try:
        library()
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("the C kernel of %s could not be built (%s); %s", library.__module__, e, fallback)
        return False
    return True


def load(source: pathlib.Path, flags: tuple[str, ...] = AVX2_FLAGS) -> ctypes.CDLL:
    """Raises OSError or subprocess.SubprocessError where it cannot be built or loaded."""
    torch.get_num_threads()  # (torch's OpenMP runtime is loaded: the kernel's libgomp resolves to it)
    return ctypes.CDLL(str(build(source, flags)))


def build(source: pathlib.Path, flags: tuple[str, ...]) -> pathlib.Path:
    """The shared library for this source and these flags, compiled into the cache directory if
    it is not there yet (atomically: another process building it at once does no harm)."""
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join((*flags, torch.__version__)).encode()).hexdigest()[:16]
    directory = cache_directory()
    target = directory / f"{source.stem}-{key}.so"
    if not target.exists():
        compiler = os.environ.get("CXX", "c++") if source.suffix == ".cpp" else os.environ.get("CC", "cc")
        fd, partial = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            subprocess.run([compiler, str(source), *flags, "-o", partial], check=True, capture_output=True,
                           timeout=120)
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return target


def cache_directory() -> pathlib.Path:
    """A directory only this user can write (a library loaded from a directory others can write
    would run their code): $XDG_CACHE_HOME/specserve, else ~/.cache/specserve, else a private
    temporary one."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    directory = pathlib.Path(base) / "specserve"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.stat()
        if info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return directory
    except OSError:
        pass
    return pathlib.Path(tempfile.mkdtemp(prefix="specserve-"))
