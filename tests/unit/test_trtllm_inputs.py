"""TensorRT-LLM backend's request inputs read as `llm`'s: renamed, batch of one, and the features
of beams or logits refused by name unless off."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backend.errors import ValidationError
from serving.triton.trtllm_inputs import llm_inputs


def _batch(value, dtype) -> np.ndarray:
    return np.array([[value]] if not isinstance(value, list) else [value], dtype=dtype)


def test_the_end_to_end_clients_inputs():
    inputs, options = llm_inputs({
        "text_input": _batch(b"Hello", np.object_), "max_tokens": _batch(8, np.int32),
        "stream": _batch(True, bool), "beam_width": _batch(1, np.int32), "temperature": _batch(0.5, np.float32),
        "stop_words": _batch([b"\n\n", b""], np.object_), "bad_words": _batch([b""], np.object_),
        "end_id": _batch(2, np.int32), "pad_id": _batch(0, np.int32), "min_length": _batch(3, np.int32),
        "random_seed": _batch(7, np.uint64), "top_k": _batch(0, np.int32), "top_p": _batch(0.0, np.float32),
        "return_log_probs": _batch(True, bool),
    })
    assert sorted(inputs) == ["exclude_input_in_output", "max_tokens", "min_tokens", "return_cumulative_logprob",
                              "sampling_parameters", "seed", "stop", "stream", "temperature", "text_input"]
    assert inputs["exclude_input_in_output"].tolist() == [True]  # streamed: the new tokens, as TensorRT-LLM
    assert inputs["stop"].tolist() == [b"\n\n"]
    assert json.loads(inputs["sampling_parameters"][0]) == {"stop_token_ids": [2]}
    assert inputs["max_tokens"].tolist() == [8] and inputs["seed"].tolist() == [7]
    assert options == {"return_batch_index": True, "return_output_log_probs": True}


@pytest.mark.parametrize("name,value,dtype,message", [
    ("beam_width", 2, np.int32, "only 1 is supported"),
    ("length_penalty", 0.5, np.float32, "only 1.0 is supported"),
    ("return_generation_logits", True, bool, "only False is supported"),
    ("bad_words", [b"no"], np.object_, "is not supported here; send it empty"),
    ("prompt_embedding_table", 1.0, np.float16, "is not an input"),
])
def test_what_needs_beams_or_logits_is_refused_by_name(name, value, dtype, message):
    with pytest.raises(ValidationError, match=f"{name}: {message}"):
        llm_inputs({"text_input": _batch(b"x", np.object_), "max_tokens": _batch(4, np.int32),
                    name: _batch(value, dtype)})


def test_one_request_per_call():
    with pytest.raises(ValidationError, match=r"text_input: must be a batch of one request \(\[1, ...\]\), got shape \[2, 1\]"):
        llm_inputs({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_)})


@pytest.mark.parametrize("guide_type,guide,expected", [
    ("json", None, {"json_object": True}),
    ("json_schema", b'{"type": "object"}', {"json": '{"type": "object"}'}),
    ("regex", b"[a-z]+", {"regex": "[a-z]+"}),
    ("ebnf_grammar", b'root ::= "a"', {"grammar": 'root ::= "a"'}),
])
def test_guided_decoding_becomes_the_engines(guide_type, guide, expected):
    values = {"text_input": _batch(b"Hi", np.object_), "max_tokens": _batch(8, np.int32), "end_id": _batch(2, np.int32),
              "guided_decoding_guide_type": _batch(guide_type.encode(), np.object_)}
    if guide is not None:
        values["guided_decoding_guide"] = _batch(guide, np.object_)
    inputs, _ = llm_inputs(values)
    assert json.loads(inputs["sampling_parameters"][0]) == {"stop_token_ids": [2], "guided_decoding": expected}
