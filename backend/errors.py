"""Errors that reach clients, and how the engine tells a request's fault from a dead engine.

A client sees one of three things when its request fails: a ValidationError's message (the field
and what is allowed; Triton INVALID_ARG), INTERNAL_ERROR (the detail is in the server log, never in
the response), or ENGINE_DEAD (UNAVAILABLE: the engine hit a fault that poisons every request).
"""
from __future__ import annotations

import sys

INTERNAL_ERROR = "internal error (see server log)"
ENGINE_DEAD = "the engine has failed and is unavailable (see server log)"
SHUTTING_DOWN = "the server is shutting down"
UNAVAILABLE_ERRORS = (ENGINE_DEAD, SHUTTING_DOWN)  # Triton UNAVAILABLE; the others are INTERNAL


class ValidationError(ValueError):
    """A request or config value outside its allowed range.

    `field` is the name the user wrote (a request input or a config key); the message says what
    range or type is allowed, so it can be passed to the client unchanged (Triton INVALID_ARG).
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def renamed(self, names: dict[str, str]) -> ValidationError:
        """The same error under the name a serving adapter gives the field (engine -> input)."""
        return ValidationError(names.get(self.field, self.field), self.message)


def abbreviate(value: object, limit: int = 40) -> str:
    """A value as an error message quotes it: its repr, cut short, whatever the client sent."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class EngineDeadError(RuntimeError):
    """The engine can take no more requests (after a fatal fault)."""


class FatalEngineError(RuntimeError):
    """A fault after which no step can be trusted (what a CUDA error is)."""


def is_fatal(error: BaseException) -> bool:
    """Does `error` poison the engine, rather than one request or one step? CUDA errors do: they
    are sticky, every later kernel launch fails too. (torch is looked up, not imported: the
    preprocessing model imports this module and has no use for torch.)"""
    if isinstance(error, FatalEngineError):
        return True
    torch = sys.modules.get("torch")
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and "CUDA error" in str(error)
