"""Incremental detokenization and stop strings, on a byte-level tokenizer (one token per byte,
so multibyte characters arrive split across tokens)."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

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


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: a word's leading space is "▁", which a token decoded alone
    loses ("▁world" alone is "world")."""
    words = ["hello", "world", "again", "STOP"]
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2} | {f"▁{w}": 3 + i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def owned(detok: IncrementalDetokenizer) -> list[str]:
    return detok.token_texts(0, len(detok.token_ends))


@pytest.mark.parametrize("stop", [[], ["🚀"], ["→ 日"], ["wör"]])
def test_each_token_owns_its_part_of_the_text(stop):
    """Joining every token's own text gives the text, cut at a stop string or not; a byte that
    only completes a character later owns nothing, the one that completes it owns the character."""
    deltas, _, detok = stream(TEXT, stop)
    texts = owned(detok)
    assert "".join(texts) == "".join(deltas) == detok.text
    assert len(texts) == len(detok.token_ends)
    if not stop:  # each character's first bytes own nothing, the last owns the character
        assert texts.count("") == len(TEXT.encode()) - len(TEXT)


def test_candidates_spell_what_the_token_would_add():
    detok = IncrementalDetokenizer(TOK, TOK.encode("Say: "), [])
    ids = TOK.encode(TEXT)
    for i, t in enumerate(ids):
        others = [ids[(i + 1) % len(ids)], TOK.eos_token_id]
        candidates = detok.candidate_texts([t, *others])
        detok.add_token(t)
        assert candidates[t] == owned(detok)[-1]
        assert candidates[TOK.eos_token_id] == ""  # a special token adds nothing (skip_special_tokens)


def test_the_tokens_that_carry_a_stop_string_own_only_what_is_left():
    tok = _metaspace_tokenizer()
    ids = tok.encode("hello world STOP again", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [0], ["d STOP"])
    assert [detok.add_token(t) for t in ids[:3]] == [False, False, True]
    assert detok.text == "hello worl" and owned(detok) == ["hello", " worl", ""]


def test_a_sentencepiece_word_keeps_its_space_and_eos_owns_nothing():
    tok = _metaspace_tokenizer()
    ids = tok.encode("hello world again", add_special_tokens=False) + [tok.eos_token_id]
    assert tok.decode(ids[1:2]) == "world"  # alone, the space is lost
    deltas, _, detok = stream_ids(tok, ids, [])
    assert owned(detok) == ["hello", " world", " again", ""] and "".join(deltas) == "hello world again"


def stream_ids(tok, ids: list[int], stop: list[str]) -> tuple[list[str], bool, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, [0], stop)
    deltas = []
    for t in ids:
        stopped = detok.add_token(t)
        deltas.append(detok.take_delta(finished=stopped))
        if stopped:
            return deltas, True, detok
    deltas.append(detok.take_delta(finished=True))
    return deltas, False, detok


def test_text_goes_out_a_whole_token_at_a_time():
    """A token whose text ends in what may become a stop string is held whole: each delta is the
    text of the tokens handed out with it."""
    tok = _metaspace_tokenizer()
    detok = IncrementalDetokenizer(tok, [0], ["again!"])
    ids = tok.encode("hello again world", add_special_tokens=False)
    handed = []
    for t in ids:
        detok.add_token(t)
        start = detok.num_emitted_tokens
        delta = detok.take_delta(False)
        assert delta == "".join(detok.token_texts(start, detok.num_emitted_tokens))
        handed.append(delta)
    assert handed == ["hello", "", " again world"]  # " again" could have begun "again!"
