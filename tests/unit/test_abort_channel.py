"""The abort channel reaches every listening instance of a model (and only that model's), and
forgets a socket whose instance is gone; the admission gate holds execute() until there is room."""
from __future__ import annotations

import queue
import threading
import time
import uuid

from serving.abort_channel import AbortListener, abort_everywhere, instances_directory
from serving.admission_gate import AdmissionGate


def test_an_abort_reaches_every_instance_of_the_model():
    model = f"m{uuid.uuid4().hex[:8]}"
    got: queue.SimpleQueue = queue.SimpleQueue()
    listeners = [AbortListener(model, f"{model}_0_{i}", lambda rid, i=i: got.put((i, rid))) for i in range(2)]
    other = AbortListener(f"{model}x", "other_0_0", lambda rid: got.put(("other", rid)))
    try:
        assert abort_everywhere(model, "request-1") == 2
        assert sorted(got.get(timeout=5) for _ in range(2)) == [(0, "request-1"), (1, "request-1")]
        listeners[1].close()
        stale = instances_directory(model) / "gone_0_0.ipc"
        stale.touch()  # an instance that died without closing
        assert abort_everywhere(model, "request-2") == 1
        assert got.get(timeout=5) == (0, "request-2")
        assert not stale.exists()
        assert got.empty()
    finally:
        for listener in [*listeners, other]:
            listener.close()


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
