"""The abort key: the secret that lets a stop request end only the requests of its own sender.

A request may carry `abort_key`, a random string its sender keeps (client/stream.py and the
OpenAI server send a fresh `secrets.token_hex(16)` with every request). A stop request names the
request (`abort_request_id`) and must carry the same key; llm_engine keeps only the key's SHA-256
digest and compares it in constant time. A request sent without a key cannot be stopped by a stop
request at all (its own stream's cancellation still ends it where the model sees it), so knowing
or guessing another client's request id is worth nothing.
"""
from __future__ import annotations

import hashlib
import hmac

from backend.errors import ValidationError

MIN_CHARS, MAX_CHARS = 16, 128
FIELD = "abort_key"


def checked_abort_key(key: str) -> str:
    """`key` if it is empty (none) or MIN_CHARS..MAX_CHARS printable ASCII characters."""
    if key and not (MIN_CHARS <= len(key) <= MAX_CHARS and key.isascii() and key.isprintable()):
        raise ValidationError(
            FIELD, f"must be {MIN_CHARS} to {MAX_CHARS} printable ASCII characters (e.g. secrets.token_hex(16)), "
            f"got {len(key)} characters"
        )
    return key


def require_stop_key(key: str) -> str:
    """A stop request's (checked) key: it must have one."""
    if not key:
        raise ValidationError(FIELD, "required with abort_request_id: the abort_key sent with the request to stop")
    return key


def key_digest(key: str) -> bytes:
    """What is kept of a request's key (b"" for none: such a request matches no stop)."""
    return hashlib.sha256(key.encode()).digest() if key else b""


def proves(digest: bytes, key: str) -> bool:
    """Whether a stop carrying `key` comes from the sender of the request kept as `digest`."""
    return bool(digest) and bool(key) and hmac.compare_digest(digest, key_digest(key))
