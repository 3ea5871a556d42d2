"""Heals a server whose engine has died: reloads llm_engine, with a backoff, or gives up.

llm_engine unloads itself when its engine fails (a CUDA error, a dead rank), so that readiness
fails at once; tritonserver itself stays live. Left alone the pod would stay alive and unready
until someone acted. The supervisor, a thread of the launcher, polls the engine model's readiness;
once it has been ready and is not, it loads the model again through the model-repository API
(with the admin key), waiting BACKOFF_S, then twice as long after each failed load, up to
MAX_BACKOFF_S. After MAX_FAILED_LOADS loads in a row that did not bring it back, `give_up()` runs:
the launcher stops tritonserver and exits non-zero, so that the container is restarted (the
liveness a Kubernetes Deployment sees is the process itself).
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from subprocess import Popen
from typing import Protocol


class ServerHandle(Protocol):
    """What the supervisor reads of the launcher's handle (serving/launch/launcher.py)."""

    process: Popen

    @property
    def http_url(self) -> str: ...

    @property
    def admin_headers(self) -> dict[str, str]: ...

ENGINE_MODEL = "llm_engine"
CHECK_INTERVAL_S = 1.0
BACKOFF_S = 2.0
MAX_BACKOFF_S = 60.0
MAX_FAILED_LOADS = 5
LOAD_TIMEOUT_S = 600.0  # a load builds the engine: weights, KV pool, warm-up


class EngineSupervisor:
    def __init__(self, handle: ServerHandle, give_up: Callable[[], None], model: str = ENGINE_MODEL,
                 backoff_s: float = BACKOFF_S, max_failed_loads: int = MAX_FAILED_LOADS,
                 log: Callable[[str], None] = print):
        self.handle, self.give_up, self.model, self.log = handle, give_up, model, log
        self.backoff_s, self.max_failed_loads = backoff_s, max_failed_loads
        self.reloads = 0  # loads that brought the model back
        self.stopping = threading.Event()
        # set from a signal handler, where no lock may be taken (Event.set takes one): the server
        # is shutting down, nothing is loaded again
        self.shutting_down = False
        self.thread = threading.Thread(target=self._watch, name="specserve-supervisor", daemon=True)

    def start(self) -> EngineSupervisor:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)

    def _sleep(self, seconds: float) -> bool:
        """Wait `seconds`; False as soon as the supervisor is stopped or the server shuts down."""
        deadline = time.monotonic() + seconds
        while not (self.stopping.is_set() or self.shutting_down):
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            self.stopping.wait(min(left, 0.25))
        return False

    def _watch(self) -> None:
        failed, wait = 0, self.backoff_s
        while self._sleep(CHECK_INTERVAL_S):
            if self.handle.process.poll() is not None or self._ready():
                failed, wait = 0, self.backoff_s
                continue
            self.log(f"specserve: {self.model} is not ready; loading it again in {wait:.0f} s")
            if not self._sleep(wait):
                return
            error = self._load()
            if error is None and self._ready():
                self.reloads += 1
                self.log(f"specserve: {self.model} is serving again")
                continue
            failed += 1
            self.log(f"specserve: loading {self.model} failed ({failed} of {self.max_failed_loads}): {error}")
            if failed >= self.max_failed_loads:
                self.log(f"specserve: giving up on {self.model}; stopping the server so that it is restarted")
                self.give_up()
                return
            wait = min(2 * wait, MAX_BACKOFF_S)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self._url(f"/v2/models/{self.model}/ready"), timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _load(self) -> str | None:
        """Load the model (its config from the repository); None, or what went wrong."""
        request = urllib.request.Request(
            self._url(f"/v2/repository/models/{self.model}/load"), data=b"{}",
            headers={"Content-Type": "application/json", **self.handle.admin_headers}, method="POST",
        )
        try:
            urllib.request.urlopen(request, timeout=LOAD_TIMEOUT_S).close()
            return None
        except urllib.error.HTTPError as e:
            try:
                return json.loads(e.read()).get("error", str(e))
            except ValueError:
                return str(e)
        except (urllib.error.URLError, OSError) as e:
            return str(e)

    def _url(self, path: str) -> str:
        return f"http://{self.handle.http_url}{path}"
