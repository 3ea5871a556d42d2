"""A suite of JSON Schemas shaped like real APIs' (tool parameters, webhook payloads, records,
configs; tests/unit/schema_suite.py), each with instances it allows and instances it does not,
run through the grammar a `json` constraint compiles (strict, and not strict: `"x-strict": false`):

- jsonschema agrees with the suite about every instance (the data is right);
- the grammar takes every valid instance (the strict one as it writes JSON, in the schema's key
  order; the other pretty-printed, and with an extra key where the schema allows one) and refuses
  every invalid one, however it is written;
- outputs sampled from the grammar (seeded walks over a byte vocabulary, no model) validate;
- a schema that uses a keyword the grammar cannot enforce is refused by name.
"""
from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import xgrammar

from backend.core.grammar_compiler import GrammarCompiler
from backend.errors import ValidationError
from tests.conftest import _byte_tokenizer
from tests.unit.schema_suite import SUITE, UNSUPPORTED
from tests.unit.test_json_schema import EOS, accepts


def pretty(value) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    return GrammarCompiler(_byte_tokenizer(), 259, (EOS,))


def compiled(grammars, schema, strict: bool) -> xgrammar.CompiledGrammar:
    return grammars.compile({"json": json.dumps(schema if strict else {**schema, "x-strict": False})})


def validator(schema) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    if "additionalItems" in json.dumps(schema):
        cls = jsonschema.Draft7Validator
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_the_suite_is_large_and_its_instances_are_what_it_says():
    """jsonschema checks the formats it has a checker for here (date-time, uri and hostname need
    optional packages): an instance that breaks only one of the others is the grammar's to refuse."""
    assert len(SUITE) >= 60
    for name, (schema, valid, invalid) in SUITE.items():
        check = validator(schema)
        assert valid and invalid, name
        for value in valid:
            assert check.is_valid(value), (name, value)
        unchecked = set(re.findall(r'"format": "([a-z0-9-]+)"', json.dumps(schema))) - set(check.format_checker.checkers)
        for value in invalid:
            assert not check.is_valid(value) or unchecked, (name, value)


@pytest.mark.parametrize("name", SUITE)
def test_the_grammar_takes_every_valid_instance_and_refuses_every_invalid_one(grammars, name):
    schema, valid, invalid = SUITE[name]
    strict, free = compiled(grammars, schema, True), compiled(grammars, schema, False)
    for value in valid:
        assert accepts(strict, json.dumps(value, ensure_ascii=False)), value
        assert accepts(free, pretty(value)) and accepts(free, compact(value)), value
    for value in invalid:
        for grammar in (strict, free):
            assert not any(accepts(grammar, text) for text in (json.dumps(value), pretty(value), compact(value))), value


@pytest.mark.parametrize("name", [n for n, (s, _, _) in SUITE.items() if s.get("type") == "object"
                                  and "additionalProperties" not in s and "properties" in s])
def test_not_strict_takes_a_key_beyond_the_schemas_where_it_allows_one(grammars, name):
    schema, valid, _ = SUITE[name]
    extra = {**valid[0], "zz_extra": [1, {"a": None}]}
    assert validator(schema).is_valid(extra)
    assert accepts(compiled(grammars, schema, False), pretty(extra))
    assert not accepts(compiled(grammars, schema, True), json.dumps(extra))  # strict: the schema's keys only


CLOSING = frozenset(b'"]},0')


def sample(grammar: xgrammar.CompiledGrammar, rng: random.Random, max_steps: int = 3000) -> str | None:
    """A seeded walk through the grammar over bytes, leaning towards closing what is open; the
    text when the grammar may end, None when the walk runs too long. Byte ED is left out: xgrammar's
    string characters include UTF-16 surrogates (ED A0-BF ..), which are not UTF-8 (a detokenizer
    writes U+FFFD for them)."""
    vocab = grammar.tokenizer_info.decoded_vocab  # token -> its bytes
    closing = np.array([0 if v[:1] == b"\xed" else 20 if v and v[0] in CLOSING else 1 for v in vocab])
    matcher = xgrammar.GrammarMatcher(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, len(vocab))
    out = bytearray()
    for _ in range(max_steps):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = np.flatnonzero(np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:len(vocab)])
        if EOS in allowed:
            return out.decode("utf-8")
        token = int(rng.choices(allowed, closing[allowed])[0])
        assert matcher.accept_token(token)
        out += vocab[token]
    return None


@pytest.mark.parametrize("name", SUITE)
def test_outputs_sampled_from_the_grammar_validate(grammars, name):
    schema = SUITE[name][0]
    check = validator(schema)
    rng = random.Random(name)
    done = 0
    for strict in (True, False):
        grammar = compiled(grammars, schema, strict)
        for _ in range(3):
            text = sample(grammar, rng)
            if text is not None:
                check.validate(json.loads(text))
                done += 1
    assert done >= 3, name


@pytest.mark.parametrize("keyword", UNSUPPORTED)
def test_a_real_schema_with_an_unsupported_keyword_is_refused_by_name(grammars, keyword):
    for strict in (True, False):
        with pytest.raises(ValidationError) as e:
            compiled(grammars, UNSUPPORTED[keyword], strict)
        assert e.value.field == "guided_decoding"
        assert f"JSON Schema keyword {keyword!r} is not supported" in e.value.message
