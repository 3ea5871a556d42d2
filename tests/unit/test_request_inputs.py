"""The preprocessing model's input rules, without a server."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backend.errors import ValidationError
from serving.triton import request_inputs


def _text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def _parse(parameters=None, **inputs):
    arrays = {"text_input": _text("hi")}
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            arrays[name] = value
        elif isinstance(value, str):
            arrays[name] = _text(value)
        elif value is None:
            arrays.pop(name, None)
    return request_inputs.parse_request(arrays, render_chat=lambda messages: f"<chat {len(messages)}>",
                                        max_prompt_bytes=1000, parameters=parameters)


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
    parsed = _parse(stream=np.array([True]), return_logprobs=np.array([True]))
    assert json.loads(parsed.options.to_json()) == {
        "stream": True, "exclude_input_in_output": True, "return_finish_reason": False,
        "return_num_input_tokens": False, "return_num_output_tokens": False, "return_logprobs": True,
        "return_cumulative_logprob": False, "null_logprobs": True, "return_output_log_probs": False,
        "return_batch_index": False,
    }
    assert parsed.params.logprobs == 0  # the chosen token's logprob, for the engine; the output is null
    asked = _parse(return_logprobs=np.array([True]), sampling_parameters='{"logprobs": 2}')
    assert asked.params.logprobs == 2 and not asked.options.null_logprobs


def test_the_prompt_precedes_a_whole_completion_and_is_never_streamed():
    """vllm_backend's defaults: exclude_input_in_output absent is false without streaming and
    true with it; false with streaming is refused."""
    assert not _parse().options.exclude_input_in_output
    assert _parse(stream=np.array([True])).options.exclude_input_in_output
    with pytest.raises(ValidationError, match="exclude_input_in_output: false is not allowed when streaming"):
        _parse(stream=np.array([True]), exclude_input_in_output=np.array([False]))


def test_request_parameters_count_like_sampling_parameters():
    parsed = _parse(parameters={"temperature": "0", "max_tokens": "3", "triton_enable_empty_final_response": True},
                    sampling_parameters='{"temperature": "0"}')
    assert (parsed.params.temperature, parsed.params.max_tokens) == (0.0, 3)
    with pytest.raises(ValidationError, match="max_tokens: given in sampling_parameters .* and as a request parameter"):
        _parse(parameters={"max_tokens": "3"}, sampling_parameters='{"max_tokens": 4}')
    with pytest.raises(ValidationError, match="parameters: unknown key 'colour'"):
        _parse(parameters={"colour": "red"})


def test_vllm_only_parameters_are_refused_unless_off():
    parsed = _parse(sampling_parameters='{"n": "1", "skip_special_tokens": true, "best_of": null}')
    assert parsed.params.max_tokens == 16
    with pytest.raises(ValidationError, match="n: is a vLLM feature this server does not have; only 1"):
        _parse(sampling_parameters='{"n": 2}')
    with pytest.raises(ValidationError, match="lora_name: is a vLLM feature"):
        _parse(parameters={"lora_name": "x"})


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
        (dict(sampling_parameters='{"colour": 2}'), "sampling_parameters"),
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


def test_priority_comes_in_sampling_parameters_or_as_a_request_parameter():
    assert _parse(sampling_parameters='{"priority": -3}').params.priority == -3
    assert _parse(parameters={"priority": "2"}).params.priority == 2
    assert _parse().params.priority == 0
    with pytest.raises(ValidationError, match="priority: must be an integer"):
        _parse(sampling_parameters='{"priority": 0.5}')
