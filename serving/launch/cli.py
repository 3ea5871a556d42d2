"""specserve-serve (`python -m serving.launch`): start tritonserver on a model repository, with the
OpenAI gateway and the engine supervisor beside it, until Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from serving.launch.launcher import (
    ADMIN_KEY_VARIABLE,
    DEFAULT_MODEL_REPOSITORY,
    REPO_ROOT,
    inherited_environment,
    start_server,
)
from serving.launch.tritonserver_binary import LaunchError


def tokenizer_dir(repository: Path) -> Path | None:
    """The tokenizer directory `preprocessing` uses (its config's `tokenizer`), if it is one."""
    config = Path(repository) / "preprocessing" / "config.pbtxt"
    found = re.search(r'key: "tokenizer", value: \{ string_value: "([^"]*)"', config.read_text()) if config.is_file() else None
    path = Path(repository) / found.group(1) if found else None  # an absolute path stays absolute
    return path if path is not None and (path / "tokenizer_config.json").is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specserve-serve", description="Serve the specserve model repository with tritonserver."
    )
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver verbosity (0: off)")
    parser.add_argument("--log-level", choices=("error", "warning", "info"), default="info")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument(
        "--exit-timeout", type=int, default=30,
        help="seconds to let requests in flight finish on Ctrl-C or SIGTERM",
    )
    parser.add_argument("--openai-port", type=int, default=9000,
                        help="the OpenAI-compatible API (serving/gateway/server.py); 0: off")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address every endpoint binds to (0.0.0.0: every interface, as in a container)")
    for endpoint in ("http", "grpc", "metrics", "openai"):
        parser.add_argument(f"--{endpoint}-address", help=f"the {endpoint} endpoint's own bind address (default: --host)")
    parser.add_argument("--reload-engine", action=argparse.BooleanOptionalAction, default=True,
                        help="load llm_engine again (with a backoff) when its engine dies; exit 1 if that keeps failing")
    args = parser.parse_args(argv)

    admin_key = os.environ.get(ADMIN_KEY_VARIABLE, "")  # else a random one that nobody is shown
    try:
        handle = start_server(
            args.model_repository,
            args.http_port,
            args.grpc_port,
            args.metrics_port,
            args.log_verbose,
            args.log_level,
            ready_timeout=args.ready_timeout,
            exit_timeout=args.exit_timeout,
            host=args.host,
            http_address=args.http_address,
            grpc_address=args.grpc_address,
            metrics_address=args.metrics_address,
            admin_key=admin_key or None,
        )
    except LaunchError as e:
        print(f"specserve-serve: {e}", file=sys.stderr)
        return 1

    openai = None
    if args.openai_port:  # beside tritonserver, stopped with it; SPECSERVE_API_KEY reaches it from here
        tokenizer = tokenizer_dir(args.model_repository)  # its chat template may render tools
        openai = subprocess.Popen([sys.executable, "-m", "serving.gateway.server", "--triton", handle.grpc_url,
                                   "--host", args.openai_address or args.host, "--port", str(args.openai_port),
                                   *(["--tokenizer", str(tokenizer)] if tokenizer else [])],
                                  cwd=REPO_ROOT, env=inherited_environment())
    gave_up = threading.Event()
    supervisor = None
    if args.reload_engine:
        from serving.launch.supervisor import EngineSupervisor

        def give_up() -> None:
            gave_up.set()
            handle.process.send_signal(signal.SIGTERM)

        supervisor = EngineSupervisor(handle, give_up, log=lambda line: print(line, file=sys.stderr, flush=True)).start()

    def forward(signum, _frame):  # a signal handler: no locks (a second signal may interrupt the first)
        if supervisor is not None:
            supervisor.shutting_down = True  # a server shutting down is not loaded again
        for process in (handle.process, openai):
            if process is not None and process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    openai_line = f"  OpenAI   http://{handle.host}:{args.openai_port}/v1 (model specserve)\n" if openai else ""
    admin = f"from {ADMIN_KEY_VARIABLE}" if admin_key else f"closed (set {ADMIN_KEY_VARIABLE} to use it)"
    print(
        f"\nspecserve is ready: model `llm`\n"
        f"  HTTP     http://{handle.http_url}/v2/models/llm/generate_stream\n"
        f"  gRPC     {handle.grpc_url}\n"
        f"{openai_line}"
        f"  metrics  {handle.metrics_url}\n"
        f"  model-repository API  {admin}\n"
        f'  try      python -m client.cli "Once upon a time" --max-tokens 64 '
        f"--url {handle.grpc_url}\n",
        flush=True,
    )
    code = handle.process.wait()
    if supervisor is not None:
        supervisor.stop()
    if openai is not None:
        openai.terminate()
        openai.wait()
    handle.stop()  # removes the runtime directory
    return 1 if gave_up.is_set() else code
