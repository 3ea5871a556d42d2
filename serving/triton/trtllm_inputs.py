"""TensorRT-LLM backend's request inputs, read as `llm`'s.

The `ensemble` model takes the names, types and shapes (a batch of one: [1, 1], word lists
[1, n]) of TensorRT-LLM backend's `ensemble`, so that its clients run unchanged; its
preprocessing step turns them into `llm`'s inputs here. Meanings follow TensorRT-LLM: `min_length`
is min_tokens, `random_seed` the seed, `end_id` a token that ends the request, `stop_words` stop
strings, `top_k`/`top_p` 0 mean off, `return_log_probs` adds `cum_log_probs` and
`output_log_probs`. What needs beams or returned logits (`beam_width` above 1, `length_penalty`,
`bad_words`, embedding bias, context or generation logits, draft tokens) is refused with an
INVALID_ARG naming the input, unless it is given at its "off" value; `pad_id` only pads batched
outputs there and is accepted as is. Guided decoding as TensorRT-LLM takes it:
`guided_decoding_guide_type` ("json": any JSON object, "json_schema", "regex", "ebnf_grammar")
with the schema, regex or grammar in `guided_decoding_guide`. A streamed request sends its new
tokens whatever `exclude_input_in_output` says, as TensorRT-LLM does (its end_to_end_grpc_client
streams with the flag false).
"""
from __future__ import annotations

import json

import numpy as np

from backend.errors import ValidationError

SAME_NAME = (
    "text_input", "max_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "stream", "exclude_input_in_output",
)
RENAMED = {"min_length": "min_tokens", "random_seed": "seed", "stop_words": "stop"}
OFF_ONLY = {  # input -> the one value accepted: a feature of beams or of returned logits
    "beam_width": 1, "length_penalty": 1.0, "num_draft_tokens": 0, "use_draft_logits": False,
    "return_context_logits": False, "return_generation_logits": False,
}
EMPTY_ONLY = ("bad_words", "embedding_bias_words", "embedding_bias_weights")
ACCEPTED = ("pad_id",)  # meaningless for one request: read and dropped
GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}
GUIDE_INPUTS = ("guided_decoding_guide_type", "guided_decoding_guide")
KNOWN = (set(SAME_NAME) | set(RENAMED) | set(OFF_ONLY) | set(EMPTY_ONLY) | set(ACCEPTED) | set(GUIDE_INPUTS)
         | {"end_id", "return_log_probs"})


def llm_inputs(inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, bool]]:
    """`llm`'s inputs for a TensorRT-LLM request, and the request options its outputs need."""
    translated: dict[str, np.ndarray] = {}
    sampling: dict = {}  # what goes in `sampling_parameters`
    options = {"return_batch_index": True}
    for name, value in inputs.items():
        if name not in KNOWN:
            raise ValidationError(name, "is not an input of this server's TensorRT-LLM ensemble")
        if value.ndim < 2 or value.shape[0] != 1:
            raise ValidationError(name, f"must be a batch of one request ([1, ...]), got shape {list(value.shape)}")
        value = value[0]
        if name in SAME_NAME:
            if name in ("top_k", "top_p") and value.size == 1 and value.reshape(-1)[0] == 0:
                continue  # 0: off, as in TensorRT-LLM
            translated[name] = value
        elif name in RENAMED:
            if name == "stop_words":
                value = np.array([w for w in value.reshape(-1) if w], dtype=np.object_)
                if not value.size:
                    continue
            translated[RENAMED[name]] = value
        elif name in OFF_ONLY:
            off = OFF_ONLY[name]
            if value.size != 1 or value.reshape(-1)[0] != off:
                raise ValidationError(name, f"only {off!r} is supported here (no beams, no returned logits)")
        elif name in EMPTY_ONLY:
            if any(w for w in value.reshape(-1)):
                raise ValidationError(name, "is not supported here; send it empty or not at all")
        elif name == "end_id":
            sampling["stop_token_ids"] = [_one_int(name, value)]
        elif name == "return_log_probs":
            if value.size != 1:
                raise ValidationError(name, f"must hold one value, got {value.size}")
            wanted = bool(value.reshape(-1)[0])
            translated["return_cumulative_logprob"] = np.array([wanted])  # cum_log_probs
            options["return_output_log_probs"] = wanted
    if "max_tokens" not in translated:
        raise ValidationError("max_tokens", "required")
    guide = _guide({name: inputs[name][0] for name in GUIDE_INPUTS if name in inputs})
    if guide is not None:
        sampling["guided_decoding"] = guide
    if sampling:
        translated["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=np.object_)
    stream = translated.get("stream")
    if stream is not None and stream.size == 1 and bool(stream.reshape(-1)[0]):
        translated["exclude_input_in_output"] = np.array([True])  # streamed: the new tokens
    return translated, options


def _guide(values: dict[str, np.ndarray]) -> dict | None:
    """vLLM's guided_decoding for TensorRT-LLM's guide type and guide; None when no type is given."""
    kind = _text("guided_decoding_guide_type", values["guided_decoding_guide_type"]) \
        if "guided_decoding_guide_type" in values else ""
    guide = _text("guided_decoding_guide", values["guided_decoding_guide"]) if "guided_decoding_guide" in values else ""
    if not kind:
        if guide:
            raise ValidationError("guided_decoding_guide_type", f"required with a guide; one of {', '.join(GUIDE_TYPES)}")
        return None
    if kind not in GUIDE_TYPES:
        raise ValidationError("guided_decoding_guide_type", f"must be one of {', '.join(GUIDE_TYPES)}, got {kind!r}")
    if kind == "json":
        return {"json_object": True}
    if not guide:
        raise ValidationError("guided_decoding_guide", f"required with guided_decoding_guide_type {kind!r}")
    return {GUIDE_TYPES[kind]: guide}


def _text(name: str, value: np.ndarray) -> str:
    if value.size != 1:
        raise ValidationError(name, f"must hold one string, got {value.size}")
    item = value.reshape(-1)[0]
    try:
        return item.decode("utf-8") if isinstance(item, bytes) else str(item)
    except UnicodeDecodeError:
        raise ValidationError(name, "is not valid UTF-8") from None


def _one_int(name: str, value: np.ndarray) -> int:
    if value.size != 1 or not np.issubdtype(value.dtype, np.integer):
        raise ValidationError(name, f"must be one integer, got {value.reshape(-1)[:3].tolist()}")
    return int(value.reshape(-1)[0])
