"""Finding tritonserver, and the command and environment the launcher prepares (no server started)."""
from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import pytest

from serving.launch import launcher, tritonserver_binary


def test_tritonserver_bin_comes_first(monkeypatch, tmp_path):
    binary = tmp_path / "tritonserver"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("TRITONSERVER_BIN", str(binary))
    server = tritonserver_binary.find_tritonserver()
    assert server.binary == binary
    assert server.backend_directory is None  # the binary's own backends


def test_tritonserver_bin_must_be_executable(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITONSERVER_BIN", str(tmp_path / "missing"))
    with pytest.raises(tritonserver_binary.LaunchError, match="TRITONSERVER_BIN"):
        tritonserver_binary.find_tritonserver()


def test_path_comes_before_the_pip_copy(monkeypatch, tmp_path):
    binary = tmp_path / "tritonserver"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.delenv("TRITONSERVER_BIN", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert tritonserver_binary.find_tritonserver().binary == binary


def test_pip_copy_gets_a_backend_directory_with_the_stub(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITONSERVER_BIN", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    server = tritonserver_binary.find_tritonserver()
    python = server.backend_directory / "python"
    for name in ("triton_python_backend_stub", "libtriton_python.so", "triton_python_backend_utils.py"):
        assert (python / name).is_file()
    assert server.library_path[0] == sysconfig.get_config_var("LIBDIR")
    assert server.library_path[1].endswith("nvidia_pytriton.libs")
    assert tritonserver_binary.find_tritonserver().backend_directory == server.backend_directory  # cached


def test_environment_puts_this_python_first(monkeypatch):
    server = launcher.Tritonserver(Path("/bin/true"), None, ["/libdir"])
    monkeypatch.setenv("LD_LIBRARY_PATH", "/old")
    env = launcher.server_environment(server)
    assert env["LD_LIBRARY_PATH"] == "/libdir:/old"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(launcher.REPO_ROOT)
    assert sysconfig.get_paths()["purelib"] in env["PYTHONPATH"].split(os.pathsep)


def test_python_without_shared_libpython_is_a_clear_error(monkeypatch):
    real = sysconfig.get_config_var
    monkeypatch.setattr(
        sysconfig, "get_config_var", lambda name: 0 if name == "Py_ENABLE_SHARED" else real(name)
    )
    with pytest.raises(tritonserver_binary.LaunchError, match="--enable-shared"):
        tritonserver_binary._shared_libpython_dir()


def test_command_names_ports_and_log_level():
    server = launcher.Tritonserver(Path("/opt/tritonserver/bin/tritonserver"), Path("/b"))
    cmd = launcher.server_command(server, Path("/repo"), 1, 2, 3, log_verbose=1, log_level="warning", admin_key="k")
    assert "--http-port=1" in cmd and "--grpc-port=2" in cmd and "--metrics-port=3" in cmd
    assert "--log-info=false" in cmd and "--log-warning=true" in cmd and "--log-verbose=1" in cmd
    assert "--backend-directory=/b" in cmd
    with pytest.raises(launcher.LaunchError, match="log level"):
        launcher.server_command(server, Path("/repo"), 1, 2, 3, log_level="debug", admin_key="k")


def test_command_binds_each_endpoint_and_restricts_the_admin_apis():
    server = launcher.Tritonserver(Path("/opt/tritonserver/bin/tritonserver"), None)
    cmd = launcher.server_command(server, Path("/repo"), 1, 2, 3, admin_key="s3cret", http_address="10.0.0.5",
                                  grpc_address="127.0.0.1", metrics_address="0.0.0.0")
    assert "--http-address=10.0.0.5" in cmd and "--grpc-address=127.0.0.1" in cmd and "--metrics-address=0.0.0.0" in cmd
    restricted = "model-repository,logging,trace,shared-memory:specserve-admin-key=s3cret"
    assert f"--http-restricted-api={restricted}" in cmd
    assert f"--grpc-restricted-protocol={restricted}" in cmd
    default = launcher.server_command(server, Path("/repo"), 1, 2, 3, admin_key="k")
    assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"} <= set(default)
    with pytest.raises(launcher.LaunchError, match="admin key"):  # never an open repository API
        launcher.server_command(server, Path("/repo"), 1, 2, 3, admin_key="")


def test_test_only_faults_and_the_admin_key_are_not_inherited(monkeypatch):
    monkeypatch.setenv("SPECSERVE_FAULT_INJECTION", "fatal_seed=1")
    monkeypatch.setenv("SPECSERVE_ADMIN_KEY", "s3cret")
    env = launcher.server_environment(launcher.Tritonserver(Path("/bin/true"), None))
    assert "SPECSERVE_FAULT_INJECTION" not in env and "SPECSERVE_ADMIN_KEY" not in env


def test_free_ports_are_distinct_when_free_port_repeats_itself(monkeypatch):
    """free_port knows nothing of the ports it gave before (none is bound until the server starts),
    so a server's three ports are taken together."""
    given = iter([5001, 5001, 5002, 5001, 5003])
    monkeypatch.setattr(launcher, "free_port", lambda host="127.0.0.1": next(given))
    assert launcher.free_ports(3) == [5001, 5002, 5003]


def test_free_ports_are_below_the_ephemeral_range_and_free():
    """An outgoing connection takes its local port from the ephemeral range; a server's port from
    there could be taken before the server binds it."""
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {launcher.free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # an outgoing connection's kind of port
        assert sock.getsockname()[1] >= low
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # nothing listens there
