"""Finding tritonserver: $TRITONSERVER_BIN, `tritonserver` on PATH (the NGC container), or the copy the
`nvidia-pytriton` wheel ships, with the Python backend directory its stub needs.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")


class LaunchError(RuntimeError):
    """tritonserver could not be found, prepared or started; the message says what to do."""


@dataclass(slots=True)
class Tritonserver:
    binary: Path
    backend_directory: Path | None  # None: the binary's own default (/opt/tritonserver/backends)
    library_path: list[str] = field(default_factory=list)  # prepended to LD_LIBRARY_PATH


def find_tritonserver() -> Tritonserver:
    explicit = os.environ.get("TRITONSERVER_BIN")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise LaunchError(f"TRITONSERVER_BIN={explicit} is not an executable file")
        return Tritonserver(Path(explicit), backend_directory=None)
    on_path = shutil.which("tritonserver")
    if on_path:
        return Tritonserver(Path(on_path), backend_directory=None)
    return _pip_tritonserver()


def _pip_tritonserver() -> Tritonserver:
    try:
        import pytriton
    except ImportError:
        raise LaunchError(
            "no tritonserver found: set TRITONSERVER_BIN, put tritonserver on PATH, "
            "or `pip install nvidia-pytriton` (ships one)"
        ) from None
    dist = Path(pytriton.__file__).parent / "tritonserver"
    binary = dist / "bin" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not binary.exists():
        raise LaunchError(f"nvidia-pytriton is installed but has no tritonserver at {binary}")
    if not stub.exists():
        shipped = sorted(p.name for p in (dist / "python_backend_stubs").iterdir())
        raise LaunchError(
            f"nvidia-pytriton has no Python backend stub for Python {version} "
            f"(it ships {', '.join(shipped)}); use one of those Python versions"
        )
    libdir = _shared_libpython_dir()
    bundled_libs = dist.parent.parent / "nvidia_pytriton.libs"
    return Tritonserver(
        binary,
        backend_directory=_prepare_backend_directory(dist, stub),
        library_path=[libdir, str(bundled_libs)],
    )


def _shared_libpython_dir() -> str:
    """Directory of this interpreter's libpythonX.Y.so, which the Python backend stub links."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    name = sysconfig.get_config_var("LDLIBRARY") or ""
    shared = sysconfig.get_config_var("Py_ENABLE_SHARED")
    if not shared or not name.endswith(".so") or not (Path(libdir) / name).exists():
        raise LaunchError(
            f"{sys.executable} has no shared libpython (Py_ENABLE_SHARED={shared}, "
            f"LIBDIR={libdir}, LDLIBRARY={name}); the Python backend stub needs "
            f"libpython{sys.version_info.major}.{sys.version_info.minor}.so. Use a Python built "
            "with --enable-shared (distribution packages are; for pyenv: "
            'PYTHON_CONFIGURE_OPTS="--enable-shared" pyenv install ...)'
        )
    return libdir


def _prepare_backend_directory(dist: Path, stub: Path) -> Path:
    """Copy the Python backend plus the stub for this Python into a cache dir, once per version."""
    sources = [dist / "backends" / "python" / name for name in PYTHON_BACKEND_FILES] + [stub]
    key = hashlib.sha256()
    for src in sources:
        st = src.stat()
        key.update(f"{src}:{st.st_size}:{st.st_mtime_ns}".encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specserve"
    backends = cache / f"triton-backends-{key.hexdigest()[:16]}"
    if (backends / "python" / stub.name).exists():
        return backends
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="backends-", dir=cache))
    (staging / "python").mkdir()
    for src in sources:
        shutil.copy2(src, staging / "python" / src.name)
    try:
        staging.rename(backends)  # atomic: concurrent launchers race safely
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return backends
