"""Start a real tritonserver on the specserve model repository.

tritonserver_binary.py finds the binary: `$TRITONSERVER_BIN`, `tritonserver` on PATH (the NGC
container), then the copy that the `nvidia-pytriton` wheel ships, with what the container has by
default: a Python backend directory holding the stub built for the running Python, and the
interpreter's shared libpython and the wheel's bundled libraries on LD_LIBRARY_PATH.

The stub embeds an isolated interpreter: it ignores PYTHONPATH and finds its prefix by looking
up `python3` on PATH. So this interpreter's bin directory goes first on PATH (inside a virtual
environment that makes the stub use the environment's site-packages, not the base Python's), and
PYTHONPATH (this repository, then site-packages) is applied by the models' own `model.py`.

What the server lets a client do (README "Security"):
- It listens on `host` (127.0.0.1 unless told otherwise; each endpoint can have its own address).
- The model-repository API (load, unload, index) and the logging, trace and shared-memory APIs
  are restricted to requests carrying the header ADMIN_HEADER with the admin key: the operator's
  SPECSERVE_ADMIN_KEY, or a fresh random key per start, kept in the handle and never printed. A
  client that could load a model could run any Python in the server; llm_engine's own unload on
  an engine failure goes through the server's in-process API and needs no key.
- SPECSERVE_FAULT_INJECTION (test-only engine faults) is never passed on from this process's
  environment; a test hands it over explicitly (`extra_env`).
- The models' IPC sockets live in a private directory made for each start (mode 0700, an
  unpredictable name: serving/triton/runtime_directory.py), removed when the server stops.

    python -m serving.launch --http-port 8000 --grpc-port 8001 --metrics-port 8002
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from serving.triton.engine_stream import GRPC_URL_VARIABLE
from serving.launch.tritonserver_binary import LaunchError, Tritonserver, find_tritonserver
from serving.triton.runtime_directory import RUNTIME_DIR_VARIABLE

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
ADMIN_HEADER = "specserve-admin-key"  # the HTTP header that carries the admin key
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"  # its gRPC metadata key, as tritonserver names it
ADMIN_KEY_VARIABLE = "SPECSERVE_ADMIN_KEY"
# What a client may use only with the admin key: loading a model runs its code in the server,
# trace and logging settings write files and expose requests, a registered shared-memory region
# can name the Python backend's own regions.
RESTRICTED_APIS = ("model-repository", "logging", "trace", "shared-memory")
TEST_ONLY_VARIABLES = ("SPECSERVE_FAULT_INJECTION",)  # never inherited, only passed by `extra_env`
ANY_ADDRESS = ("0.0.0.0", "::", "")


@dataclass
class ServerHandle:
    """A running tritonserver; `stop()` shuts it down (SIGTERM, then SIGKILL after a timeout)."""

    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    host: str = "127.0.0.1"  # where clients of this process reach it
    log_path: Path | None = None
    admin_key: str = field(default="", repr=False)  # for the restricted APIs (ADMIN_HEADER)
    runtime_dir: Path | None = None  # the models' private directory, removed by stop()

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def is_ready(self) -> bool:
        """/v2/health/ready answers 200, and so does the metrics endpoint (tritonserver starts it
        after the others: a client reading metrics at once after ready found its port closed)."""
        return _answers_200(f"http://{self.host}:{self.http_port}/v2/health/ready") and _answers_200(self.metrics_url)

    def log_tail(self, num_chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-num_chars:]

    @property
    def admin_headers(self) -> dict[str, str]:
        """HTTP headers for the restricted APIs, e.g. loading a model."""
        return {ADMIN_HEADER: self.admin_key}

    @property
    def grpc_admin_headers(self) -> dict[str, str]:
        """The same as gRPC metadata."""
        return {GRPC_ADMIN_HEADER: self.admin_key}

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.runtime_dir is not None:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def inherited_environment() -> dict[str, str]:
    """This process's environment, less what a child must never inherit: test-only faults and the
    admin key (the launcher alone uses it)."""
    return {k: v for k, v in os.environ.items() if k not in TEST_ONLY_VARIABLES and k != ADMIN_KEY_VARIABLE}


def server_environment(server: Tritonserver) -> dict[str, str]:
    env = inherited_environment()
    lib_path = server.library_path + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    if lib_path:
        env["LD_LIBRARY_PATH"] = ":".join(lib_path)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    site_packages = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    # the stub reads no .pth file, so the editable install's mapping of specserve_kernels is spelled out
    python_path = [str(REPO_ROOT), str(REPO_ROOT / "kernels"), *sorted(site_packages)]
    python_path += [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env["PYTHONPATH"] = ":".join(python_path)
    env["SPECSERVE_PYTHON"] = sys.executable  # the engine core process runs on it (the stub is no Python)
    return env


def server_command(
    server: Tritonserver,
    model_repository: Path,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    log_verbose: int = 0,
    log_level: str = "info",
    exit_timeout: int = 30,
    admin_key: str = "",
    http_address: str = "127.0.0.1",
    grpc_address: str = "127.0.0.1",
    metrics_address: str = "127.0.0.1",
) -> list[str]:
    if not admin_key:
        raise LaunchError("an admin key is needed: the model-repository API is never left open")
    levels = ("error", "warning", "info")
    if log_level not in levels:
        raise LaunchError(f"log level must be one of {levels}, got {log_level!r}")
    enabled = levels[: levels.index(log_level) + 1]
    cmd = [
        str(server.binary),
        f"--model-repository={model_repository}",
        f"--http-address={http_address}",
        f"--http-port={http_port}",
        f"--grpc-address={grpc_address}",
        f"--grpc-port={grpc_port}",
        f"--metrics-address={metrics_address}",
        f"--metrics-port={metrics_port}",
        f"--http-restricted-api={','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={admin_key}",
        f"--grpc-restricted-protocol={','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={admin_key}",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        "--disable-auto-complete-config",  # the configs are complete; skips a stub start per model
        # explicit, loading every model: llm_engine can unload itself when its engine dies (so
        # that it reports not ready), which Triton allows only in this mode
        "--model-control-mode=explicit",
        "--load-model=*",
        f"--log-verbose={log_verbose}",
        f"--exit-timeout-secs={exit_timeout}",  # on shutdown, wait this long for requests in flight
        *(f"--log-{level}={str(level in enabled).lower()}" for level in levels),
    ]
    if server.backend_directory is not None:
        cmd.append(f"--backend-directory={server.backend_directory}")
    return cmd


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, taken below the kernel's range of ephemeral ports: a port
    from bind(0) comes from that range, where any outgoing connection (a readiness poll) may take
    it as its local port before the server binds it, and tritonserver then starts without that
    endpoint."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    first = max(1024, low - 12000)
    for _ in range(100):
        port = first + secrets.randbelow(low - first)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise LaunchError(f"no free port between {first} and {low}")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports (free_port alone may give the same one twice: nothing binds it
    between calls), e.g. a server's HTTP, gRPC and metrics ports."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


def _reachable(address: str) -> str:
    """The address to connect to an endpoint bound to `address` from this host."""
    return "127.0.0.1" if address in ANY_ADDRESS else address


def _url(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def start_server(
    model_repository: str | Path = DEFAULT_MODEL_REPOSITORY,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    log_verbose: int = 0,
    log_level: str = "info",
    log_file: str | Path | IO | None = None,
    ready_timeout: float = 300.0,
    exit_timeout: int = 30,
    extra_env: dict[str, str] | None = None,
    crash_retries: int = 1,
    host: str = "127.0.0.1",
    http_address: str | None = None,
    grpc_address: str | None = None,
    metrics_address: str | None = None,
    admin_key: str | None = None,
) -> ServerHandle:
    """Start tritonserver and wait until /v2/health/ready and /metrics answer 200. A server killed by a
    signal before it is ready is started again, up to `crash_retries` times.

    `log_file`: a path (the server's stdout and stderr are written there), an open file, or None
    (inherit this process's stdout and stderr). `host`: the address every endpoint binds to,
    unless its own (`http_address`, ...) is given. `admin_key`: the key of the restricted APIs
    (None: a fresh random one, in the handle).
    """
    model_repository = Path(model_repository).resolve()
    if not model_repository.is_dir():
        raise LaunchError(f"model repository not found: {model_repository}")
    server = find_tritonserver()
    admin_key = admin_key or secrets.token_urlsafe(32)
    addresses = [address or host for address in (http_address, grpc_address, metrics_address)]
    cmd = server_command(
        server, model_repository, http_port, grpc_port, metrics_port, log_verbose, log_level,
        exit_timeout, admin_key, *addresses,
    )
    runtime_dir = Path(tempfile.mkdtemp(prefix="specserve-"))  # mode 0700, a name nobody can guess
    own = {  # llm_bls reaches llm_engine through the server's own gRPC endpoint
        RUNTIME_DIR_VARIABLE: str(runtime_dir), GRPC_URL_VARIABLE: _url(_reachable(addresses[1]), grpc_port),
    }
    env = server_environment(server) | own | (extra_env or {})
    log_path = Path(log_file) if isinstance(log_file, (str, Path)) else None
    out = open(log_path, "ab") if log_path else log_file  # noqa: SIM115
    try:
        process = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None, cwd=REPO_ROOT
        )
    finally:
        if log_path:
            out.close()  # the child holds its own descriptor
    reach = _reachable(addresses[0])
    handle = ServerHandle(process, http_port, grpc_port, metrics_port, host=reach, log_path=log_path,
                          admin_key=admin_key, runtime_dir=runtime_dir)
    deadline = time.monotonic() + ready_timeout
    while not handle.is_ready():
        if process.poll() is not None:
            if process.returncode < 0 and crash_retries > 0:
                # the python backend can abort while starting its stubs on a starved CPU
                # (boost::interprocess::lock_exception, SIGABRT); a second start succeeds
                shutil.rmtree(runtime_dir, ignore_errors=True)
                return start_server(
                    model_repository, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                    log_verbose=log_verbose, log_level=log_level, log_file=log_file,
                    ready_timeout=ready_timeout, exit_timeout=exit_timeout, extra_env=extra_env,
                    crash_retries=crash_retries - 1, host=host, http_address=http_address,
                    grpc_address=grpc_address, metrics_address=metrics_address, admin_key=admin_key,
                )
            shutil.rmtree(runtime_dir, ignore_errors=True)
            raise LaunchError(
                f"tritonserver exited with code {process.returncode} before it was ready"
                + (f"; log tail:\n{handle.log_tail()}" if log_path else "")
            )
        if time.monotonic() > deadline:
            handle.stop()
            raise LaunchError(f"tritonserver not ready after {ready_timeout:.0f} s")
        time.sleep(0.25)
    return handle


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False
