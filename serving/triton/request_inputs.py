"""Turn the public inputs of `llm` into a prompt, validated SamplingParams and request options.

Plain Python (no Triton imports), so the rules can be tested on their own. Inputs arrive as a
dict of name -> numpy array (what the request carried), and sampling values may also come as the
request's Triton parameters (vllm_backend's clients send both); every problem is a
ValidationError that names the input and what is allowed. The work per request is bounded before it is done: a prompt
longer than `max_prompt_bytes` is refused before it is tokenized, and JSON is parsed only within a size and a
nesting depth (a deeply nested document would otherwise exhaust Python's recursion limit).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from backend.errors import ValidationError, abbreviate
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
    """How llm_engine shapes the responses; passed on as JSON beside the sampling params. As in
    vllm_backend, the prompt precedes a whole completion unless excluded, and is never streamed."""

    stream: bool = False  # a response per new text delta, else one response with the completion
    exclude_input_in_output: bool | None = None  # None: True when streaming, else False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False
    return_cumulative_logprob: bool = False
    # set by preprocessing, not inputs of `llm`:
    null_logprobs: bool = False  # return_logprobs without the sampling parameter `logprobs`: null
    return_output_log_probs: bool = False  # TensorRT-LLM's per-token logprobs (its return_log_probs)
    return_batch_index: bool = False  # TensorRT-LLM's batch_index (always 0: one request per call)

    def __post_init__(self) -> None:
        if self.exclude_input_in_output is None:
            self.exclude_input_in_output = bool(self.stream)
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise ValidationError(f.name, f"must be a boolean, got {abbreviate(getattr(self, f.name))}")
        if self.stream and not self.exclude_input_in_output:
            raise ValidationError("exclude_input_in_output", "false is not allowed when streaming")

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})


INTERNAL_OPTIONS = ("null_logprobs", "return_output_log_probs", "return_batch_index")
OPTION_INPUTS = tuple(f.name for f in fields(RequestOptions) if f.name not in INTERNAL_OPTIONS)
# vLLM sampling parameters this engine does not have: accepted only at the value that means "off"
VLLM_ONLY_PARAMETERS: dict[str, Any] = {
    "n": 1, "best_of": None, "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False,
    "prompt_logprobs": None, "logit_bias": None, "allowed_token_ids": None, "bad_words": None,
    "lora_name": None, "truncate_prompt_tokens": None,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
    "detokenize": True,
}
MAX_SAMPLING_PARAMETERS_BYTES = 65536
MAX_JSON_DEPTH = 32  # sampling_parameters needs 2 (an object of lists), messages 3, a JSON Schema more
# vLLM's other name for guided_decoding (its newer StructuredOutputsParams, as a JSON string or object)
ALIASES = {"structured_outputs": "guided_decoding"}
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


def parse_request(inputs: dict[str, np.ndarray], render_chat, max_prompt_bytes: int,
                  parameters: dict[str, Any] | None = None) -> ParsedRequest:
    """`render_chat(messages: list[dict]) -> str` applies the tokenizer's chat template.
    `max_prompt_bytes`: the longest prompt (UTF-8) that could fit the context; longer ones are
    refused before any tokenizing. `parameters`: the request's Triton parameters (Triton's own
    are ignored); a value given in several places must agree."""
    prompt, from_messages = _prompt(inputs, render_chat, max_prompt_bytes)
    values = _sampling_parameters(inputs)
    for name, value in _request_parameters(parameters or {}).items():
        if name in values and not _same(values[name], value):
            raise ValidationError(
                name,
                f"given in sampling_parameters ({abbreviate(values[name])}) and as a request parameter "
                f"({abbreviate(value)}) with different values; give it once",
            )
        values[name] = value
    for name in SAMPLING_INPUTS + OPTION_INPUTS:
        if name not in inputs:
            continue
        value = _single_input(name, inputs[name])
        if name in values and not _same(values[name], value):
            raise ValidationError(
                name,
                f"given as an input ({abbreviate(value)}) and in sampling_parameters ({abbreviate(values[name])}) "
                "with different values; give it once",
            )
        values[name] = value
    options = RequestOptions(**{k: values.pop(k) for k in OPTION_INPUTS if k in values})
    if (options.return_logprobs or options.return_cumulative_logprob) and values.get("logprobs") is None:
        values["logprobs"] = 0  # the engine computes the chosen token's logprob
        options.null_logprobs = True  # but `logprobs` was not asked for: the output is null
    params = SamplingParams.from_dict(values)
    return ParsedRequest(prompt, from_messages, params, options)


def triton_parameters(request) -> dict[str, Any]:
    """A Triton request's parameters (pb_utils.InferenceRequest.parameters(), a JSON object)."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except ValueError:
        raise ValidationError("parameters", "malformed") from None
    return parameters if isinstance(parameters, dict) else {}


def _prompt(inputs: dict[str, np.ndarray], render_chat, max_prompt_bytes: int) -> tuple[str, bool]:
    has_text, has_messages = "text_input" in inputs, "messages" in inputs
    if has_text and has_messages:
        raise ValidationError("text_input", "give text_input or messages, not both")
    if has_messages:
        # JSON escapes take up to 6 bytes per byte of text (\u00e9); the rendered chat is
        # checked against max_prompt_bytes itself
        messages = _load_json("messages", inputs["messages"], 6 * max_prompt_bytes)
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
        prompt = render_chat(messages)
        _check_prompt_bytes("messages", len(prompt.encode("utf-8")), max_prompt_bytes)
        return prompt, True
    if not has_text:
        raise ValidationError("text_input", "required (or give messages, a JSON chat)")
    text = scalar_text("text_input", inputs["text_input"])
    _check_prompt_bytes("text_input", len(text.encode("utf-8")), max_prompt_bytes)
    if not text:
        raise ValidationError("text_input", "empty prompt")
    return text, False


def _check_prompt_bytes(name: str, num_bytes: int, max_prompt_bytes: int) -> None:
    if num_bytes > max_prompt_bytes:
        raise ValidationError(
            name,
            f"the prompt is {num_bytes} bytes; at most {max_prompt_bytes} bytes can fit the "
            "model's context (its length in tokens times the longest token's bytes)",
        )


def _sampling_parameters(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    if "sampling_parameters" not in inputs:
        return {}
    values = _load_json("sampling_parameters", inputs["sampling_parameters"], MAX_SAMPLING_PARAMETERS_BYTES)
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValidationError("sampling_parameters", "must be a JSON object")
    return _known_values("sampling_parameters", values)


def _request_parameters(parameters: dict[str, Any]) -> dict[str, Any]:
    """Sampling values among the request's parameters; Triton's own are skipped: triton_*, and the
    request id that HTTP generate passes on as `id`."""
    return _known_values("parameters", {k: v for k, v in parameters.items()
                                        if not k.startswith("triton_") and k != "id"})


def _known_values(source: str, values: dict[str, Any]) -> dict[str, Any]:
    """Sampling values by name, coerced; a vLLM-only feature at its "off" value is dropped."""
    known = {}
    for key, value in values.items():
        if key in ALIASES:
            if ALIASES[key] in values:
                raise ValidationError(key, f"give {key} or {ALIASES[key]}, not both")
            key = ALIASES[key]
        if key in VLLM_ONLY_PARAMETERS:
            off = VLLM_ONLY_PARAMETERS[key]
            if not (value is None or _same(_coerce_like(off, value), off)):
                raise ValidationError(key, f"is a vLLM feature this server does not have; only {off!r} is accepted")
            continue
        if key not in SAMPLING_PARAMETER_KEYS:
            raise ValidationError(
                source, f"unknown key {abbreviate(key)}; allowed: {', '.join(SAMPLING_PARAMETER_KEYS)}"
            )
        known[key] = _coerce(key, value)
    return known


def _coerce_like(example: Any, value: Any) -> Any:
    """A string value ("1", "true") read as the type of `example`."""
    if not isinstance(value, str) or example is None or isinstance(example, str):
        return value
    if isinstance(example, bool):
        return {"true": True, "false": False}.get(value.lower(), value)
    try:
        return type(example)(value)
    except ValueError:
        return value


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


def _load_json(name: str, array: np.ndarray, max_bytes: int) -> Any:
    """One JSON document of at most `max_bytes` bytes and MAX_JSON_DEPTH levels; None if blank."""
    raw = scalar_text(name, array, max_bytes)
    if not raw.strip():
        return None
    if _json_depth(raw) > MAX_JSON_DEPTH:
        raise ValidationError(name, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValidationError(name, f"malformed JSON: {e.msg} at character {e.pos}") from None


def _json_depth(text: str) -> int:
    """The deepest nesting of [ and { outside strings (an upper bound when the JSON is malformed)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


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


def scalar_text(name: str, array: np.ndarray, max_bytes: int | None = None) -> str:
    if array.size != 1:
        raise ValidationError(name, f"must hold one string, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if max_bytes is not None and isinstance(value, bytes) and len(value) > max_bytes:
        raise ValidationError(name, f"is {len(value)} bytes; at most {max_bytes} are allowed")
    return _decode(name, value)


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
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-7)
        except OverflowError:  # an integer beyond float range equals no FP32 value
            return False
    if isinstance(a, str) and isinstance(b, list):
        return [a] == b
    return a == b
