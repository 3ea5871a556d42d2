"""The preprocessing model's input rules, without a server."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backend.errors import ValidationError
from serving import request_inputs


def _text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def _parse(**inputs):
    arrays = {"text_input": _text("hi")}
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            arrays[name] = value
        elif isinstance(value, str):
            arrays[name] = _text(value)
        elif value is None:
            arrays.pop(name, None)
    return request_inputs.parse_request(arrays, render_chat=lambda messages: f"<chat {len(messages)}>", max_prompt_bytes=1000)


def test_single_inputs_become_sampling_params():
    parsed = _parse(
        max_tokens=np.array([7], dtype=np.int32),
        temperature=np.array([0.7], dtype=np.float32),
        seed=np.array([2**63], dtype=np.uint64),
        stop=np.array([b"\n\n", b"END"], dtype=np.object_),
        ignore_eos=np.array([True]),
    )
    p = parsed.params
    assert (p.max_tokens, p.temperature, p.seed, p.stop, p.ignore_eos) == (7, 0.7, 2**63, ["\n\n", "END"], True)
    assert parsed.prompt == "hi" and not parsed.from_messages


def test_options_are_split_from_sampling_params():
    parsed = _parse(stream=np.array([True]), exclude_input_in_output=np.array([False]),
                    return_logprobs=np.array([True]))
    assert json.loads(parsed.options.to_json()) == {
        "stream": True, "exclude_input_in_output": False, "return_finish_reason": False,
        "return_num_input_tokens": False, "return_num_output_tokens": False, "return_logprobs": True,
    }
    assert parsed.params.logprobs == 0  # the chosen token's logprob


def test_sampling_parameters_accept_vllm_style_strings():
    parsed = _parse(sampling_parameters=json.dumps(
        {"temperature": "0.5", "max_tokens": "9", "ignore_eos": "true", "stop": "###", "stream": True}
    ))
    p = parsed.params
    assert (p.temperature, p.max_tokens, p.ignore_eos, p.stop) == (0.5, 9, True, ["###"])
    assert parsed.options.stream


def test_input_and_json_must_agree():
    same = _parse(temperature=np.array([0.7], dtype=np.float32), sampling_parameters='{"temperature": 0.7}')
    assert same.params.temperature == 0.7
    with pytest.raises(ValidationError, match="temperature: given as an input") as e:
        _parse(temperature=np.array([0.5], dtype=np.float32), sampling_parameters='{"temperature": 0.7}')
    assert e.value.field == "temperature"


@pytest.mark.parametrize(
    "inputs,field",
    [
        (dict(text_input=""), "text_input"),
        (dict(text_input=None), "text_input"),
        (dict(messages='[{"role": "user", "content": "x"}]'), "text_input"),
        (dict(text_input=None, messages="{"), "messages"),
        (dict(text_input=None, messages="[]"), "messages"),
        (dict(sampling_parameters="[]"), "sampling_parameters"),
        (dict(sampling_parameters='{"n": 2}'), "sampling_parameters"),
        (dict(sampling_parameters='{"top_k": "many"}'), "top_k"),
        (dict(sampling_parameters='{"stop": 5}'), "stop"),
        (dict(max_tokens=np.array([1, 2], dtype=np.int32)), "max_tokens"),
        (dict(top_p=np.array([0.0], dtype=np.float32)), "top_p"),
    ],
)
def test_bad_inputs_name_their_field(inputs, field):
    with pytest.raises(ValidationError) as e:
        _parse(**inputs)
    assert e.value.field == field


def test_messages_are_rendered():
    parsed = _parse(text_input=None, messages='[{"role": "user", "content": "x"}]')
    assert parsed.prompt == "<chat 1>" and parsed.from_messages
