"""Parameter validation: one error type that names the field and the allowed range."""
import pytest

from backend.errors import ValidationError
from backend.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.2}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"temperature": float("nan")}, "temperature"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")


def test_range_in_message():
    with pytest.raises(ValidationError, match=r"top_p: must be in \(0.0, 1.0\], got 1.5"):
        SamplingParams(top_p=1.5)


def test_unknown_key_is_an_error():
    with pytest.raises(ValidationError) as e:
        SamplingParams.from_dict({"max_tokens": 4, "temprature": 0.5})
    assert e.value.field == "temprature" and "allowed" in str(e.value)


def test_valid_round_trip():
    p = SamplingParams.from_dict({"max_tokens": 8, "temperature": 0, "stop": "\n", "seed": 7})
    assert p.greedy and p.stop == ["\n"] and SamplingParams.from_dict(p.to_dict()) == p
