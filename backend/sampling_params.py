"""Per-request sampling parameters, validated on construction.

Every field is type-checked and range-checked here, so that nothing a client sends can fail later
inside a step: integers are bounded (no 64-bit overflow in a tensor), floats are finite, the
temperature follows vLLM's rule (below 1e-5 is greedy; up to 1e-2 is raised to 1e-2, where the
softmax stays finite), the repetition penalty keeps vLLM's upper bound and a lower bound that cannot
overflow the logits. Token ids are checked against the vocabulary by the engine, which knows it.
`guided_decoding` is checked for its shape here (one constraint, within size bounds); whether the
schema, regex or grammar compiles is checked by the engine, which has the tokenizer
(backend/core/grammar_compiler.py).
"""
from __future__ import annotations

import dataclasses
import json
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
MAX_GUIDE_CHARS = 65536  # a JSON schema, regex or grammar
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
# vLLM's guided decoding (StructuredOutputsParams): one of these constraints ...
GUIDE_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# ... and its other keys, accepted at the values that change nothing here (the backend is xgrammar)
GUIDE_OFF_VALUES: dict[str, tuple] = {
    "backend": (None, "", "auto", "xgrammar", "xgrammar:no-fallback"),
    "whitespace_pattern": (None,), "structural_tag": (None,), "disable_fallback": (None, False, True),
    "disable_any_whitespace": (None, False), "disable_additional_properties": (None, False),
}


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
    priority: int = 0  # scheduling order, vLLM's: lower first (admitted first, preempted last)
    # the output must match one constraint, vLLM's keys: {"json": schema} (a dict, or its JSON text),
    # {"regex": str}, {"choice": [str, ...]}, {"grammar": EBNF str}, {"json_object": true};
    # normalized to {kind: text}, a choice to its list, json_object to True
    guided_decoding: dict[str, Any] | None = None

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
        self.priority = _check_int("priority", self.priority, -INT32_MAX - 1, INT32_MAX)
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, 0, 20)
        self.stop = _check_stop(self.stop)
        self.stop_token_ids = _check_list("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, INT32_MAX)
        for name in ("ignore_eos", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValidationError(name, f"must be a boolean, got {abbreviate(getattr(self, name))}")
        if self.guided_decoding is not None:
            self.guided_decoding = _check_guide(self.guided_decoding)
            if self.ignore_eos or self.min_tokens:  # the constraint decides where the output may end
                raise ValidationError("guided_decoding", "cannot be combined with ignore_eos or min_tokens")

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


def _check_guide(value: Any) -> dict[str, Any]:
    """vLLM's guided_decoding object (or its JSON text, as vllm_backend takes it) -> {kind: value}."""
    name = "guided_decoding"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise ValidationError(name, "must be a JSON object") from None
    if not isinstance(value, dict):
        raise ValidationError(name, f"must be an object with one of {', '.join(GUIDE_KINDS)}, got {abbreviate(value)}")
    for key, v in value.items():
        if key not in GUIDE_KINDS and key not in GUIDE_OFF_VALUES:
            raise ValidationError(name, f"unknown key {abbreviate(key)}; allowed: "
                                        f"{', '.join(GUIDE_KINDS + tuple(GUIDE_OFF_VALUES))}")
        if key in GUIDE_OFF_VALUES and v not in GUIDE_OFF_VALUES[key]:
            raise ValidationError(name, f"{key} must be one of {list(GUIDE_OFF_VALUES[key])}, got {abbreviate(v)}")
    kinds = [k for k in GUIDE_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise ValidationError(name, f"must set exactly one of {', '.join(GUIDE_KINDS)}, got {len(kinds)}")
    kind, v = kinds[0], value[kinds[0]]
    if kind == "json_object":
        if v is not True:
            raise ValidationError(name, f"json_object must be true, got {abbreviate(v)}")
        return {kind: True}
    if kind == "choice":
        choices = _check_list(f"{name}.choice", v, MAX_CHOICES)
        if not choices or not all(isinstance(c, str) and 1 <= len(c) <= MAX_CHOICE_CHARS for c in choices):
            raise ValidationError(name, f"choice must be 1 to {MAX_CHOICES} strings of 1 to {MAX_CHOICE_CHARS} "
                                        f"characters, got {abbreviate(v)}")
        return {kind: choices}
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except (json.JSONDecodeError, RecursionError) as e:
                raise ValidationError(name, f"json is not valid JSON: {getattr(e, 'msg', 'too deep')}") from None
        if not isinstance(v, (dict, bool)):
            raise ValidationError(name, f"json must be a JSON Schema (an object), got {abbreviate(v)}")
        v = json.dumps(v)  # its text (property order kept: the output follows it) is the cache key
    if not isinstance(v, str) or not 1 <= len(v) <= MAX_GUIDE_CHARS:
        raise ValidationError(name, f"{kind} must be a string of 1 to {MAX_GUIDE_CHARS} characters, got {abbreviate(v)}")
    return {kind: v}


def _check_stop(value: Any) -> list[str]:
    stop = _check_list("stop", [value] if isinstance(value, str) else value, MAX_STOP_STRINGS)
    for s in stop:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
            raise ValidationError(
                "stop", f"must be a list of strings of 1 to {MAX_STOP_STRING_CHARS} characters, got {abbreviate(s)}"
            )
    return stop
