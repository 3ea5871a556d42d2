"""Per-request sampling parameters, validated on construction.

Every field is type-checked and range-checked here, so that nothing a client sends can fail later
inside a step: integers are bounded (no 64-bit overflow in a tensor), floats are finite, the
temperature follows vLLM's rule (below 1e-5 is greedy; up to 1e-2 is raised to 1e-2, where the
softmax stays finite), the repetition penalty keeps vLLM's upper bound and a lower bound that cannot
overflow the logits. Token ids are checked against the vocabulary by the engine, which knows it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from backend.errors import ValidationError, abbreviate

UINT64_MAX = 2**64 - 1
INT32_MAX = 2**31 - 1
GREEDY_TEMPERATURE = 1e-5  # below this, temperature means greedy (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = 1e-2  # a positive temperature below this is raised to it (vLLM's _MAX_TEMP)
MIN_REPETITION_PENALTY = 0.01  # logits / 0.01 stay finite in float32
MAX_REPETITION_PENALTY = 2.0  # vLLM's bound
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # drop tokens with p < min_p * p_max
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # per-request generator: tokens do not depend on batch-mates
    stop: list[str] = field(default_factory=list)  # stop strings, cut from the output
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stops are suppressed before this many output tokens
    logprobs: int | None = None  # None: no logprobs; n >= 0: chosen token + top-n
    speculative: bool = True  # per-request opt-out of speculative decoding

    def __post_init__(self) -> None:
        self.max_tokens = _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        self.temperature = _check_float("temperature", self.temperature, 0.0, None)
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        elif self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        self.top_p = _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.top_k = _check_int("top_k", self.top_k, -1, INT32_MAX)
        self.min_p = _check_float("min_p", self.min_p, 0.0, 1.0)
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY
        )
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, 0, UINT64_MAX)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, 0, 20)
        self.stop = _check_stop(self.stop)
        self.stop_token_ids = _check_list("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, INT32_MAX)
        for name in ("ignore_eos", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValidationError(name, f"must be a boolean, got {abbreviate(getattr(self, name))}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a JSON-like dict; unknown keys are an error naming them."""
        unknown = sorted(set(values) - cls.field_names(), key=str)
        if unknown:
            raise ValidationError(
                str(unknown[0])[:40],
                f"unknown sampling parameter; allowed: {', '.join(sorted(cls.field_names()))}",
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(name, f"must be an integer in [{low}, {high}], got {abbreviate(value)}")
    if not low <= value <= high:
        raise ValidationError(name, f"must be in [{low}, {high}], got {abbreviate(value)}")
    return value


def _check_float(name: str, value: Any, low: float, high: float | None, low_open: bool = False) -> float:
    lo = "(" if low_open else "["
    allowed = f"{lo}{low}, {high}]" if high is not None else f"{'>' if low_open else '>='} {low}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(name, f"must be a number {'in ' if high is not None else ''}{allowed}, got {abbreviate(value)}")
    try:
        value = float(value)
    except OverflowError:  # an integer beyond float range
        raise ValidationError(name, f"must be in {allowed}, got {abbreviate(value)}") from None
    too_low = value <= low if low_open else value < low
    if math.isnan(value) or math.isinf(value) or too_low or (high is not None and value > high):
        raise ValidationError(name, f"must be in {allowed}, got {abbreviate(value)}")
    return value


def _check_list(name: str, value: Any, max_len: int) -> list:
    if not isinstance(value, (list, tuple)):
        raise ValidationError(name, f"must be a list (at most {max_len} items), got {abbreviate(value)}")
    if len(value) > max_len:
        raise ValidationError(name, f"must hold at most {max_len} items, got {len(value)}")
    return list(value)


def _check_stop(value: Any) -> list[str]:
    stop = _check_list("stop", [value] if isinstance(value, str) else value, MAX_STOP_STRINGS)
    for s in stop:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
            raise ValidationError(
                "stop", f"must be a list of strings of 1 to {MAX_STOP_STRING_CHARS} characters, got {abbreviate(s)}"
            )
    return stop
