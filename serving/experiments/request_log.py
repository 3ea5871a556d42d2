"""An experiment's request log: one JSON line per request the gateway served in the experiment,
appended as it ends, bounded by rotation (LOG, LOG.1, ... LOG.<backups>, oldest last).

    {"time": 1718000000.12, "arm": "speculative", "user": "3f2a...", "status": "ok", "period": 2,
     "ttft_s": 0.081, "itl_s": 0.021, "e2e_s": 1.43, "output_tokens": 64}

    time     seconds since the epoch when the request ended
    arm      the arm that served it
    user     the sticky key's value, hashed with the experiment's name (null: the request had none)
    status   "ok"; "error" (the server failed it); "client_error" (a 4xx: the request was bad);
             "cancelled" (the client went away first)
    period   which stretch of constant weights it fell in (a weight change starts the next)
    ttft_s, itl_s, e2e_s, output_tokens   for requests that produced tokens: seconds to the first
             token, mean seconds between the later ones (2 tokens or more), to the end (ok only)

The verdict (serving/experiments/verdict.py) reads these columns; `specserve-ab replay LOG` runs it over a log,
`specserve-ab replay LOG LOG ...` over several gateway replicas' logs at once (read_logs).
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

STATUSES = ("ok", "error", "client_error", "cancelled")
LATENCIES = ("ttft_s", "itl_s", "e2e_s")
MAX_BYTES = 64 << 20  # per file
BACKUPS = 8
CHUNK = 4096  # requests per batch when a log is read back


@dataclass(slots=True)
class LoggedRequest:
    time: float
    arm: str
    user: str | None
    status: str
    period: int
    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0

    def line(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}, separators=(",", ":")) + "\n"


def hash_user(experiment: str, key: str | None) -> str | None:
    """The logged form of a sticky key: not the key itself, the same for the same key."""
    return None if key is None else hashlib.sha256(f"{experiment}\x00{key}".encode()).hexdigest()[:16]


@dataclass(slots=True)
class RequestColumns:
    """A batch of logged requests, column by column, in arrival order."""
    arm: np.ndarray  # [n] object: arm names
    user: np.ndarray  # [n] object: hashed keys, None for a request without one
    status: np.ndarray  # [n] object: one of STATUSES
    period: np.ndarray  # [n] int64
    ttft_s: np.ndarray  # [n] float64, nan where absent
    itl_s: np.ndarray  # [n] float64, nan where absent
    e2e_s: np.ndarray  # [n] float64, nan where absent

    def __len__(self) -> int:
        return len(self.arm)

    def __getitem__(self, rows: slice) -> RequestColumns:
        return RequestColumns(*(getattr(self, f.name)[rows] for f in fields(self)))

    @classmethod
    def from_records(cls, records: list[dict]) -> RequestColumns:
        def column(name, dtype=object, missing=None):
            return np.array([missing if r.get(name) is None else r[name] for r in records], dtype=dtype)

        return cls(column("arm"), column("user"), column("status"), column("period", np.int64, 0),
                   *(column(name, np.float64, math.nan) for name in LATENCIES))


class RequestLog:
    """Appends lines to LOG, rotating it at max_bytes; keeps `backups` older files."""

    def __init__(self, path: str | Path, max_bytes: int = MAX_BYTES, backups: int = BACKUPS):
        self.path, self.max_bytes, self.backups = Path(path), max_bytes, backups
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", encoding="utf-8")

    def append(self, request: LoggedRequest) -> None:
        self.file.write(request.line())
        self.file.flush()
        if self.file.tell() >= self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        self.file.close()
        for i in range(self.backups, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                if i == self.backups:
                    older.unlink()
                else:
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.backups:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self.file = open(self.path, "w", encoding="utf-8")

    def close(self) -> None:
        self.file.close()


def log_files(path: str | Path) -> list[Path]:
    """A log's files, oldest first."""
    path = Path(path)
    rotated = sorted((p for p in path.parent.glob(f"{path.name}.*") if p.suffix[1:].isdigit()),
                     key=lambda p: -int(p.suffix[1:]))
    return rotated + ([path] if path.exists() else [])


def read_logs(paths: list[str | Path], chunk: int = CHUNK) -> Iterator[list[dict]]:
    """Several gateway replicas' logs as one, in time order, `chunk` at a time. Each replica's
    period p becomes p * replicas + its index, a stratum of its own: replicas whose weights changed
    at different times, or that serve at different speeds, are compared arm against arm within
    each, and a user whose requests went to several replicas is still one unit (the sticky key's
    hash is the same everywhere). One log reads as read_log."""
    if len(paths) == 1:
        yield from read_log(paths[0], chunk)
        return

    def records(index: int, path: str | Path) -> Iterator[dict]:
        for batch in read_log(path, chunk):
            for record in batch:
                yield record | {"period": int(record.get("period", 0)) * len(paths) + index}

    merged = heapq.merge(*(records(i, p) for i, p in enumerate(paths)), key=lambda r: float(r.get("time", 0.0)))
    while batch := list(itertools.islice(merged, chunk)):
        yield batch


def read_log(path: str | Path, chunk: int = CHUNK) -> Iterator[list[dict]]:
    """The log's records in arrival order, `chunk` at a time; a torn last line is skipped."""
    batch: list[dict] = []
    for file in log_files(path):
        with open(file, encoding="utf-8") as lines:
            for line in lines:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and "arm" in record and "status" in record:
                    batch.append(record)
                if len(batch) >= chunk:
                    yield batch
                    batch = []
    if batch:
        yield batch
