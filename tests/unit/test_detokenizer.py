"""Incremental detokenization and stop strings, on a byte-level tokenizer (one token per byte,
so multibyte characters arrive split across tokens)."""
import pytest

from backend.core.detokenizer import IncrementalDetokenizer
from tests.conftest import _byte_tokenizer

TOK = _byte_tokenizer()
TEXT = "héllo wörld → 日本語 🚀\n\tdef f(x):  return  x"


def stream(text: str, stop: list[str], prompt: str = "Say: ") -> tuple[list[str], bool, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(TOK, TOK.encode(prompt), stop)
    deltas, stopped = [], False
    for t in TOK.encode(text):
        stopped = detok.add_token(t)
        deltas.append(detok.take_delta(finished=stopped))
        if stopped:
            break
    if not stopped:
        deltas.append(detok.take_delta(finished=True))
    return deltas, stopped, detok


def test_stream_equals_full_decode_with_multibyte_and_spaces():
    deltas, stopped, _ = stream(TEXT, [])
    assert not stopped
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # incomplete UTF-8 sequences were held until complete


def test_stop_string_cut_exactly():
    deltas, stopped, detok = stream("abc STOP def", ["STOP"])
    assert stopped and "".join(deltas) == "abc " and detok.text == "abc "


def test_first_of_several_stop_strings_wins():
    deltas, stopped, _ = stream("one\n\ntwo END", ["END", "\n\n"])
    assert stopped and "".join(deltas) == "one"


def test_stop_string_prefix_is_held_back_then_released():
    detok = IncrementalDetokenizer(TOK, [], ["STOP"])
    seen = []
    for t in TOK.encode("a STO"):
        detok.add_token(t)
        seen.append(detok.take_delta(False))
    assert "".join(seen) == "a "  # "STO" could still become "STOP"
    for t in TOK.encode("X"):
        assert not detok.add_token(t)
    assert detok.take_delta(False) == "STOX"


@pytest.mark.parametrize("stop", ["🚀", "→ 日"])
def test_multibyte_stop_string(stop):
    deltas, stopped, _ = stream(TEXT, [stop])
    assert stopped and "".join(deltas) == TEXT[: TEXT.index(stop)]
