"""The engine core process: an LLMEngine and its EngineLoop, driven over ZeroMQ.

    python -m backend.engine_core --config JSON --requests ADDR --outputs ADDR --parent PID

`EngineCoreClient` (engine_core_client.py) starts it: the client binds both sockets, this process
connects. Requests come in on a PULL socket as pickled tuples, ("add", request id, prompt ids,
SamplingParams), ("abort", request id) or ("stop",); everything goes out on PUSH sockets (one per
sending thread, ZeroMQ sockets being single-threaded): ("ready", RequestLimits, EngineStats) once
the engine is built, or ("failed", message); then ("output", RequestOutput) and, at most every
STATS_INTERVAL_S, ("stats", EngineStats); ("dead",) once a fatal fault has ended every request.
The process exits when told to stop, or when its parent is gone (checked every poll).
"""
from __future__ import annotations

import argparse
import logging
import os
import threading
import time

import zmq

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.engine_loop import EngineLoop
from backend.fault_injection import fault_hook_from_env
from backend.outputs import RequestOutput

log = logging.getLogger(__name__)
POLL_MS = 100
STATS_INTERVAL_S = 0.1


class _Outbox:
    """A PUSH socket per thread, all connected to the client's one PULL socket."""

    def __init__(self, context: zmq.Context, address: str):
        self.context, self.address = context, address
        self.local = threading.local()

    def send(self, message: tuple) -> None:
        socket = getattr(self.local, "socket", None)
        if socket is None:
            socket = self.local.socket = self.context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 1000)
            socket.connect(self.address)
        socket.send_pyobj(message)


def serve(config: EngineConfig, requests_address: str, outputs_address: str, parent_pid: int) -> int:
    context = zmq.Context()
    outbox = _Outbox(context, outputs_address)
    inbox = context.socket(zmq.PULL)
    inbox.connect(requests_address)
    try:
        engine = LLMEngine(config)
        engine.fault_hook = fault_hook_from_env(os.environ.get("SPECSERVE_FAULT_INJECTION"))
    except Exception as e:
        log.exception("the engine could not start")
        outbox.send(("failed", f"{type(e).__name__}: {e}"))
        return 1
    loop = EngineLoop(engine)
    last_stats = 0.0

    def on_output(output: RequestOutput) -> None:  # the engine thread
        nonlocal last_stats
        outbox.send(("output", output))
        now = time.monotonic()
        if now - last_stats >= STATS_INTERVAL_S or output.finished:
            last_stats = now
            outbox.send(("stats", engine.stats()))

    loop.start()
    outbox.send(("ready", engine.limits, engine.stats()))
    reported_dead = False
    while os.getppid() == parent_pid:
        if loop.dead and not reported_dead:
            outbox.send(("dead",))
            reported_dead = True
        if not inbox.poll(POLL_MS):
            continue
        message = inbox.recv_pyobj()
        if message[0] == "add":
            _, request_id, prompt_ids, params = message
            loop.add(request_id, prompt_ids, params, on_output)
        elif message[0] == "abort":
            loop.abort(message[1])
        else:  # stop
            break
    loop.shutdown()  # aborts what is left: each request gets its final output
    context.destroy(linger=1000)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description="specserve engine core process")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--requests", required=True, help="ZeroMQ address the client sends requests on")
    parser.add_argument("--outputs", required=True, help="ZeroMQ address the client receives outputs on")
    parser.add_argument("--parent", type=int, required=True, help="exit when this process is gone")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="engine core: %(levelname)s %(message)s")
    config = EngineConfig.from_json(args.config)
    raise SystemExit(serve(config, args.requests, args.outputs, args.parent))


if __name__ == "__main__":
    main()
