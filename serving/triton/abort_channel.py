"""Stops by Triton request id and abort key, delivered to every instance of the engine model on
this server.

A request may be running on any instance of llm_engine, and an instance that holds back new work
(llm_engine's `max_pending_requests`) takes no request from Triton's queue, aborts included. So
aborts travel beside Triton: each instance listens on a ZeroMQ PULL socket in a directory of its
server and model, and `abort_everywhere` pushes the stop to every socket there. The models in
front of the engine (preprocessing for `llm`, llm_bls) and the engine's own control requests use it.

    {the server's private directory}/aborts/{model name}/{instance name}.ipc

The directory is the server's own (serving/triton/runtime_directory.py: mode 0700, owned by this user),
so no other local user can push a stop, and two servers on one host never see each other's
instances. A message is JSON {"request_id": str, "abort_key": str}; anything else is dropped.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import zmq

from serving.triton.runtime_directory import private_subdirectory, runtime_directory

ENGINE_MODEL = "llm_engine"  # the model whose instances listen
SEND_TIMEOUT_MS = 250  # a listener connects within a millisecond; a stale socket file never does
POLL_MS = 100  # how often the listener checks that it is still wanted
MAX_MESSAGE_BYTES = 1024  # an id and a key; a longer message is dropped unread


def instances_directory(model_name: str) -> Path:
    aborts = private_subdirectory(runtime_directory(), "aborts")
    return private_subdirectory(aborts, model_name)


def abort_everywhere(model_name: str, triton_request_id: str, abort_key: str) -> int:
    """Push the stop to every listening instance of `model_name`; returns how many took it."""
    message = json.dumps({"request_id": triton_request_id, "abort_key": abort_key})
    delivered = 0
    context = zmq.Context.instance()
    for path in sorted(instances_directory(model_name).glob("*.ipc")):
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, SEND_TIMEOUT_MS)
        socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a socket nobody listens on
        try:
            socket.connect(f"ipc://{path}")
            socket.send_string(message)
            delivered += 1
        except zmq.ZMQError:  # a stale socket file: its instance is gone
            path.unlink(missing_ok=True)
        finally:
            socket.close()
    return delivered


def parse_stop(message: bytes) -> tuple[str, str] | None:
    """(request id, abort key) from a message, or None if it is not a well-formed stop."""
    try:
        stop = json.loads(message)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(stop, dict) or stop.keys() != {"request_id", "abort_key"}:
        return None
    if not all(isinstance(v, str) for v in stop.values()):
        return None
    return stop["request_id"], stop["abort_key"]


class AbortListener:
    """One instance's socket: `on_abort(triton_request_id, abort_key)` runs on the listener's thread."""

    def __init__(self, model_name: str, instance_name: str, on_abort: Callable[[str, str], None]):
        directory = instances_directory(model_name)
        self.path = directory / f"{instance_name}.ipc"
        self.path.unlink(missing_ok=True)  # left by a crashed instance of the same name
        self.on_abort = on_abort
        self.socket = zmq.Context.instance().socket(zmq.PULL)  # used by the listener's thread only
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a peer sending more is disconnected
        self.socket.bind(f"ipc://{self.path}")
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._listen, name="specserve-aborts", daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        while not self.stopping.is_set():
            if self.socket.poll(POLL_MS):
                stop = parse_stop(self.socket.recv())
                if stop is not None:
                    self.on_abort(*stop)
        self.socket.close()

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self.stopping.set()
        self.thread.join(timeout=5)
