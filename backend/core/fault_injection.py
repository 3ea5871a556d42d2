"""A test-only fault hook: chosen requests raise inside a step, where their tokens are appended
and detokenized, to show that one request's fault harms no other.

The engine calls `engine.fault_hook(request)` (when set) for each request it appends tokens to.
llm_engine sets it from the environment variable SPECSERVE_FAULT_INJECTION, unset in production:
    "seed=<n>"        a request with that seed raises an ordinary exception after two tokens
    "fatal_seed=<n>"  the same, but a FatalEngineError (as a CUDA error would be): the engine dies
"""
from __future__ import annotations

from typing import Callable

from backend.core.request import Request
from backend.errors import FatalEngineError

FaultHook = Callable[[Request], None]
FAULT_AFTER_TOKENS = 2


class InjectedFault(RuntimeError):
    pass


def fault_hook(seed: int, fatal: bool = False) -> FaultHook:
    error = FatalEngineError if fatal else InjectedFault

    def hook(request: Request) -> None:
        if request.params.seed == seed and request.num_output_tokens >= FAULT_AFTER_TOKENS:
            raise error(f"injected fault in request {request.request_id}")

    return hook


def fault_hook_from_env(value: str | None) -> FaultHook | None:
    """The hook SPECSERVE_FAULT_INJECTION's value asks for, or None when it is unset or empty."""
    if not value:
        return None
    kind, _, seed = value.partition("=")
    if kind not in ("seed", "fatal_seed") or not seed.isdigit():
        raise ValueError(f'SPECSERVE_FAULT_INJECTION must be "seed=<n>" or "fatal_seed=<n>", got {value!r}')
    return fault_hook(int(seed), fatal=kind == "fatal_seed")
