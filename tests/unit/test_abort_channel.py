"""The abort channel reaches every listening instance of a model (and only that model's), forgets
a socket whose instance is gone and drops what is not a stop; its directory is private; stops that
match nothing are remembered in bounded memory; the admission gate holds execute() until there is
room."""
from __future__ import annotations

import os
import queue
import stat
import threading
import time
import uuid

import pytest
import zmq

from serving.triton.abort_channel import AbortListener, abort_everywhere, instances_directory
from serving.triton.abort_key import checked_abort_key, key_digest, proves
from serving.triton.admission_gate import AdmissionGate
from backend.errors import ValidationError
from serving.triton.early_aborts import EarlyAborts
from serving.triton.runtime_directory import UnsafeDirectoryError, private_subdirectory, runtime_directory


def test_an_abort_reaches_every_instance_of_the_model():
    model = f"m{uuid.uuid4().hex[:8]}"
    got: queue.SimpleQueue = queue.SimpleQueue()
    listeners = [AbortListener(model, f"{model}_0_{i}", lambda rid, key, i=i: got.put((i, rid, key))) for i in range(2)]
    other = AbortListener(f"{model}x", "other_0_0", lambda rid, key: got.put(("other", rid, key)))
    try:
        assert abort_everywhere(model, "request-1", "key-1") == 2
        assert sorted(got.get(timeout=5) for _ in range(2)) == [(0, "request-1", "key-1"), (1, "request-1", "key-1")]
        listeners[1].close()
        stale = instances_directory(model) / "gone_0_0.ipc"
        stale.touch()  # an instance that died without closing
        assert abort_everywhere(model, "request-2", "key-2") == 1
        assert got.get(timeout=5) == (0, "request-2", "key-2")
        assert not stale.exists()
        assert got.empty()
    finally:
        for listener in [*listeners, other]:
            listener.close()


def test_what_is_not_a_stop_is_dropped_and_the_listener_serves_on():
    model = f"m{uuid.uuid4().hex[:8]}"
    got: queue.SimpleQueue = queue.SimpleQueue()
    listener = AbortListener(model, f"{model}_0_0", lambda rid, key: got.put((rid, key)))
    try:
        socket = zmq.Context.instance().socket(zmq.PUSH)
        socket.connect(f"ipc://{listener.path}")
        for junk in (b"\x80\x04\x95not json", b"[1, 2]", b'{"request_id": 1, "abort_key": "k"}',
                     b'{"request_id": "a"}', b"x" * 100_000):
            socket.send(junk)
        socket.close(linger=1000)
        assert abort_everywhere(model, "request-3", "key-3") == 1
        assert got.get(timeout=5) == ("request-3", "key-3")
        assert got.empty()
    finally:
        listener.close()


def test_the_channel_directory_is_private_and_a_foreign_one_is_refused(tmp_path, monkeypatch):
    directory = instances_directory(f"m{uuid.uuid4().hex[:8]}")
    for level in (directory, directory.parent, directory.parent.parent):
        assert stat.S_IMODE(os.lstat(level).st_mode) == 0o700
        assert os.lstat(level).st_uid == os.getuid()
    open_to_all = tmp_path / "open"
    open_to_all.mkdir(mode=0o777)
    open_to_all.chmod(0o777)
    with pytest.raises(UnsafeDirectoryError, match="mode 777"):
        private_subdirectory(tmp_path, "open")
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeDirectoryError, match="not a directory"):
        private_subdirectory(tmp_path, "link")
    monkeypatch.setenv("SPECSERVE_RUNTIME_DIR", str(open_to_all))
    with pytest.raises(UnsafeDirectoryError):
        runtime_directory()


def test_a_stop_proves_its_sender_only_with_the_requests_key():
    digest = key_digest("the-senders-key-0123")
    assert proves(digest, "the-senders-key-0123")
    assert not proves(digest, "the-senders-key-0124")
    assert not proves(digest, "")
    assert not proves(key_digest(""), "")  # a request without a key matches no stop
    assert checked_abort_key("") == ""
    for bad in ("short", "x" * 129, "é" * 20, "tab\there-0123456789"):
        with pytest.raises(ValidationError, match="abort_key: must be 16 to 128"):
            checked_abort_key(bad)


def test_unmatched_stops_are_bounded_and_forgotten_oldest_first():
    early = EarlyAborts(memory_s=60.0, capacity=100)
    for i in range(10_000):  # a flood of stops for made-up ids
        early.remember(str(i), key_digest(f"guess-{i:012d}"))
    assert len(early) == 100
    now = time.monotonic()
    assert not early.take("0", key_digest(f"guess-{0:012d}"), now)  # forgotten
    assert early.take("9999", key_digest(f"guess-{9999:012d}"), now)
    early.remember("7", key_digest("the-senders-key-0123"))
    assert not early.take("7", key_digest("another-key-01234567"), now)  # the key must match
    assert early.take("7", key_digest("the-senders-key-0123"), now)
    assert not early.take("7", key_digest("the-senders-key-0123"), now)  # once
    brief = EarlyAborts(memory_s=0.05, capacity=100)
    brief.remember("8", key_digest("the-senders-key-0123"))
    time.sleep(0.1)
    assert not brief.take("8", key_digest("the-senders-key-0123"), time.monotonic())  # expired


def test_the_gate_holds_until_a_pending_request_starts():
    gate = AdmissionGate(limit=1)
    gate.taken()
    gate.wait_for_room(lambda: False)  # one pending: room
    gate.taken()
    released = threading.Event()
    waiter = threading.Thread(target=lambda: (gate.wait_for_room(lambda: False), released.set()))
    waiter.start()
    time.sleep(0.2)
    assert not released.is_set()  # two pending, limit one
    gate.started()
    assert released.wait(5)
    waiter.join()
    AdmissionGate(limit=0).wait_for_room(lambda: False)  # no limit: never waits
