"""Aborts by Triton request id, delivered to every instance of the engine model on this server.

A request may be running on any instance of llm_engine, and an instance that holds back new work
(llm_engine's `max_pending_requests`) takes no request from Triton's queue, aborts included. So
aborts travel beside Triton: each instance listens on a ZeroMQ PULL socket in a directory of its
server and model, and `abort_everywhere` pushes the id to every socket there. The models in front
of the engine (preprocessing for `llm`, llm_bls) and the engine's own control requests use it.

    {tmp}/specserve-{tritonserver pid}/{model name}/{instance name}.ipc

Every Python model of one server is a child process of that tritonserver, so its pid names the
server: two servers on one host never see each other's instances.
"""
from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import zmq

ENGINE_MODEL = "llm_engine"  # the model whose instances listen
SEND_TIMEOUT_MS = 250  # a listener connects within a millisecond; a stale socket file never does
POLL_MS = 100  # how often the listener checks that it is still wanted


def instances_directory(model_name: str, server_pid: int | None = None) -> Path:
    server_pid = os.getppid() if server_pid is None else server_pid
    return Path(tempfile.gettempdir()) / f"specserve-{server_pid}" / model_name


def abort_everywhere(model_name: str, triton_request_id: str) -> int:
    """Push the id to every listening instance of `model_name`; returns how many took it."""
    delivered = 0
    context = zmq.Context.instance()
    for path in sorted(instances_directory(model_name).glob("*.ipc")):
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, SEND_TIMEOUT_MS)
        socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a socket nobody listens on
        try:
            socket.connect(f"ipc://{path}")
            socket.send_string(triton_request_id)
            delivered += 1
        except zmq.ZMQError:  # a stale socket file: its instance is gone
            path.unlink(missing_ok=True)
        finally:
            socket.close()
    return delivered


class AbortListener:
    """One instance's socket: `on_abort(triton_request_id)` runs on the listener's thread."""

    def __init__(self, model_name: str, instance_name: str, on_abort: Callable[[str], None]):
        directory = instances_directory(model_name)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{instance_name}.ipc"
        self.path.unlink(missing_ok=True)  # left by a crashed instance of the same name
        self.on_abort = on_abort
        self.socket = zmq.Context.instance().socket(zmq.PULL)  # used by the listener's thread only
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(f"ipc://{self.path}")
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._listen, name="specserve-aborts", daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        while not self.stopping.is_set():
            if self.socket.poll(POLL_MS):
                self.on_abort(self.socket.recv_string())
        self.socket.close()

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self.stopping.set()
        self.thread.join(timeout=5)
