"""Turn the public inputs of `llm` into a prompt, validated SamplingParams and request options.

Plain Python (no Triton imports), so the rules can be tested on their own. Inputs arrive as a
dict of name -> numpy array (what the request carried); every problem is a ValidationError that
names the input and what is allowed.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from backend.errors import ValidationError
from backend.sampling_params import SamplingParams

# Single inputs that map one-to-one onto SamplingParams fields.
SAMPLING_INPUTS = (
    "max_tokens",
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_tokens",
    "seed",
    "stop",
    "ignore_eos",
)


@dataclass(slots=True)
class RequestOptions:
    """How llm_engine shapes the responses; passed on as JSON beside the sampling params."""

    stream: bool = False  # a response per new text delta, else one response with the completion
    exclude_input_in_output: bool = True  # False: the prompt text precedes the completion
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})


OPTION_INPUTS = tuple(f.name for f in fields(RequestOptions))
# Keys `sampling_parameters` accepts: every SamplingParams field and every option flag.
SAMPLING_PARAMETER_KEYS = sorted(SamplingParams.field_names() | set(OPTION_INPUTS))
_FIELD_TYPES = {f.name: str(f.type) for f in fields(SamplingParams)} | {
    name: "bool" for name in OPTION_INPUTS
}


@dataclass(slots=True)
class ParsedRequest:
    prompt: str  # text as given, or the chat rendered with the tokenizer's template
    from_messages: bool  # the template already holds the special tokens
    params: SamplingParams
    options: RequestOptions


def parse_request(inputs: dict[str, np.ndarray], render_chat) -> ParsedRequest:
    """`render_chat(messages: list[dict]) -> str` applies the tokenizer's chat template."""
    prompt, from_messages = _prompt(inputs, render_chat)
    values = _sampling_parameters(inputs)
    for name in SAMPLING_INPUTS + OPTION_INPUTS:
        if name not in inputs:
            continue
        value = _single_input(name, inputs[name])
        if name in values and not _same(values[name], value):
            raise ValidationError(
                name,
                f"given as an input ({value!r}) and in sampling_parameters ({values[name]!r}) "
                "with different values; give it once",
            )
        values[name] = value
    options = RequestOptions(**{k: values.pop(k) for k in OPTION_INPUTS if k in values})
    if options.return_logprobs and values.get("logprobs") is None:
        values["logprobs"] = 0  # the chosen token's logprob
    if not isinstance(values.get("stop", []), (list, str)):
        raise ValidationError("stop", f"must be a list of strings, got {values['stop']!r}")
    params = SamplingParams.from_dict(values)
    return ParsedRequest(prompt, from_messages, params, options)


def _prompt(inputs: dict[str, np.ndarray], render_chat) -> tuple[str, bool]:
    has_text, has_messages = "text_input" in inputs, "messages" in inputs
    if has_text and has_messages:
        raise ValidationError("text_input", "give text_input or messages, not both")
    if has_messages:
        raw = _scalar_text("messages", inputs["messages"])
        try:
            messages = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValidationError("messages", f"malformed JSON: {e}") from None
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValidationError(
                "messages",
                'must be a non-empty JSON list of {"role": str, "content": str} objects',
            )
        return render_chat(messages), True
    if not has_text:
        raise ValidationError("text_input", "required (or give messages, a JSON chat)")
    text = _scalar_text("text_input", inputs["text_input"])
    if not text:
        raise ValidationError("text_input", "empty prompt")
    return text, False


def _sampling_parameters(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    if "sampling_parameters" not in inputs:
        return {}
    raw = _scalar_text("sampling_parameters", inputs["sampling_parameters"])
    if not raw.strip():
        return {}
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValidationError("sampling_parameters", f"malformed JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValidationError("sampling_parameters", "must be a JSON object")
    unknown = sorted(set(values) - set(SAMPLING_PARAMETER_KEYS))
    if unknown:
        raise ValidationError(
            "sampling_parameters",
            f"unknown key {unknown[0]!r}; allowed: {', '.join(SAMPLING_PARAMETER_KEYS)}",
        )
    return {k: _coerce(k, v) for k, v in values.items()}


def _coerce(name: str, value: Any) -> Any:
    """vllm_backend clients send numbers as strings ("temperature": "0.7"); accept those."""
    if not isinstance(value, str):
        return value
    kind = _FIELD_TYPES.get(name, "")
    try:
        if kind.startswith("bool"):
            if value.lower() in ("true", "false"):
                return value.lower() == "true"
        elif kind.startswith("int"):
            return int(value)
        elif kind.startswith("float"):
            return float(value)
        elif kind.startswith("list[str]"):
            return [value]
    except ValueError:
        pass
    return value  # SamplingParams names the field and its type


def _single_input(name: str, array: np.ndarray) -> Any:
    if name == "stop":
        return [_decode(name, v) for v in array.reshape(-1)]
    if array.size != 1:
        raise ValidationError(name, f"must hold one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if array.dtype == np.bool_:
        return bool(value)
    if np.issubdtype(array.dtype, np.integer):
        return int(value)
    if np.issubdtype(array.dtype, np.floating):
        return float(str(value))  # shortest repr: FP32 0.7 stays 0.7, not 0.699999988
    return _decode(name, value)


def _scalar_text(name: str, array: np.ndarray) -> str:
    if array.size != 1:
        raise ValidationError(name, f"must hold one string, got shape {list(array.shape)}")
    return _decode(name, array.reshape(-1)[0])


def _decode(name: str, value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValidationError(name, "is not valid UTF-8") from None
    return str(value)


def _same(a: Any, b: Any) -> bool:
    """Equal up to FP32 precision (an input is FP32, a JSON number is a double)."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-7)
    if isinstance(a, str) and isinstance(b, list):
        return [a] == b
    return a == b
