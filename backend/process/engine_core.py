"""The engine core process: an LLMEngine and its EngineLoop, driven over ZeroMQ.

    python -m backend.process.engine_core --config JSON --requests ADDR --outputs ADDR --parent PID

`EngineCoreClient` (engine_core_client.py) starts it: the client binds both sockets (in a
directory only its user can enter), this process connects. The messages are typed
(backend/process/core_messages.py): AddRequest, AbortRequest or StopRequest come in on a PULL socket, and
one that is none of them is logged and dropped; everything goes out on PUSH sockets (one per
sending thread, ZeroMQ sockets being single-threaded): Ready once the engine is built, or Failed;
then an Output per request output and, at most every STATS_INTERVAL_S, Stats; Dead once a fatal
fault has ended every request. The process exits when told to stop, or when its parent is gone
(checked every poll).
"""
from __future__ import annotations

import argparse
import logging
import os
import threading
import time

import zmq

from backend.config import EngineConfig
from backend.core.fault_injection import fault_hook_from_env
from backend.engine import LLMEngine
from backend.engine_loop import EngineLoop
from backend.errors import ValidationError
from backend.outputs import RequestOutput
from backend.parallel import wire
from backend.process import core_messages
from backend.process.core_messages import (
    AbortRequest,
    AddRequest,
    Dead,
    Failed,
    Output,
    Ready,
    Stats,
)

log = logging.getLogger(__name__)
POLL_MS = 100
STATS_INTERVAL_S = 0.1


class _Outbox:
    """A PUSH socket per thread, all connected to the client's one PULL socket."""

    def __init__(self, context: zmq.Context, address: str):
        self.context, self.address = context, address
        self.local = threading.local()

    def send(self, message: Ready | Failed | Output | Stats | Dead) -> None:
        socket = getattr(self.local, "socket", None)
        if socket is None:
            socket = self.local.socket = self.context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 1000)
            socket.connect(self.address)
        socket.send(wire.encode(message))


def serve(config: EngineConfig, requests_address: str, outputs_address: str, parent_pid: int) -> int:
    context = zmq.Context()
    outbox = _Outbox(context, outputs_address)
    inbox = context.socket(zmq.PULL)
    inbox.connect(requests_address)

    def make_engine() -> LLMEngine:
        engine = LLMEngine(config)
        engine.fault_hook = fault_hook_from_env(os.environ.get("SPECSERVE_FAULT_INJECTION"))
        return engine

    try:
        loop = EngineLoop.build(make_engine)  # built on the thread that steps it
    except Exception as e:
        log.exception("the engine could not start")
        outbox.send(Failed(f"{type(e).__name__}: {e}"))
        return 1
    engine = loop.engine
    last_stats = 0.0

    def on_output(output: RequestOutput) -> None:  # the engine thread
        nonlocal last_stats
        outbox.send(Output(output))
        now = time.monotonic()
        if now - last_stats >= STATS_INTERVAL_S or output.finished:
            last_stats = now
            outbox.send(Stats(engine.stats()))

    loop.start()
    outbox.send(Ready(engine.limits, engine.stats()))
    reported_dead = False
    while os.getppid() == parent_pid:
        if loop.dead and not reported_dead:
            outbox.send(Dead())
            reported_dead = True
        if not inbox.poll(POLL_MS):
            continue
        try:
            message = core_messages.REQUESTS.decode(inbox.recv())
        except wire.WireError as e:
            log.error("dropped a message on the requests socket: %s", e)
            continue
        if isinstance(message, AddRequest):
            if message.params.guided_decoding is not None:  # compiled here, not in a step (the client checked it)
                try:
                    engine.grammars.compile(message.params.guided_decoding)
                except ValidationError:
                    pass  # add_request raises it again: the request ends with it
            loop.add(message.request_id, message.prompt_ids, message.params, on_output)
        elif isinstance(message, AbortRequest):
            loop.abort(message.request_id)
        else:  # StopRequest
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
