"""JSON Schema for guided decoding (backend/core/json_schema.py): every keyword is enforced by the
compiled grammar or refused by name, bounds refuse hostile schemas before they compile, and the
compile time bound refuses a slow one without holding anyone else up.

A grammar is checked by its matcher over a byte-level vocabulary: an instance is accepted when the
matcher takes all of its text and then EOS, so no model is needed."""
from __future__ import annotations

import json
import time

import hypothesis.strategies as st
import pytest
import xgrammar
from hypothesis import example, given, settings

from backend.core.grammar_compiler import GrammarCompiler
from backend.core.json_schema import prepare
from backend.core.json_schema_limits import repetition_size
from backend.core.json_schema_patterns import search_as_match
from backend.errors import ValidationError
from tests.conftest import _byte_tokenizer

EOS = 1


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    return GrammarCompiler(_byte_tokenizer(), 259, (EOS,))


def accepts(compiled: xgrammar.CompiledGrammar, text: str) -> bool:
    """The whole of `text`, then the end, is allowed."""
    matcher = xgrammar.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(EOS) and matcher.is_terminated()


def compile_json(grammars: GrammarCompiler, schema, strict: bool = True) -> xgrammar.CompiledGrammar:
    return grammars.compile({"json": json.dumps(schema if strict else {**schema, "x-strict": False})})


def dumps(value, strict: bool = True) -> str:
    """An instance as a strict grammar writes it (", " and ": "), or pretty-printed."""
    return json.dumps(value) if strict else json.dumps(value, indent=2)


# schema, instances it allows, instances it does not: each keyword xgrammar alone ignores, with the
# rewrite that makes it enforced
ENFORCED = {
    "allOf_bounds": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, [5, 70], [4, "a"]),
    "allOf_objects": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                 {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
                      [{"a": 1, "b": "x"}], [{"a": 1}, {"b": "x"}]),
    "allOf_types": ({"allOf": [{"type": ["integer", "string"]}, {"type": ["string", "null"]}]}, ["a"], [1, None]),
    "ref_with_keywords": ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "maximum": 3}, [3], [4]),
    "oneOf_types": ({"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, [7, "ab"], ["abc", True]),
    "oneOf_discriminator": ({"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
         "required": ["kind", "lives"]},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
         "required": ["kind", "good"]}]},
        [{"kind": "cat", "lives": 9}, {"kind": "dog", "good": True}], [{"kind": "cat", "good": True}]),
    "anyOf_beside_properties": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                 "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
                                [{"a": 1}, {"b": 2}, {"a": 1, "b": 2}], [{}]),
    "enum_beside_maxLength": ({"enum": ["a", "abc", 5], "maxLength": 1, "type": "string"}, ["a"], ["abc", 5]),
    "const_beside_enum": ({"const": "x", "enum": ["x", "y"]}, ["x"], ["y"]),
    "required_not_in_properties": ({"type": "object", "required": ["id"]}, [{"id": 1}], [{}]),
    "unanchored_pattern": ({"type": "string", "pattern": "^sk-"}, ["sk-abc", "sk-"], ["pk-abc", "xsk-"]),
    "pattern_in_the_middle": ({"type": "string", "pattern": "[0-9]"}, ["a1b", "7"], ["ab"]),
    "pattern_alternatives": ({"type": "string", "pattern": "^a|b$"}, ["ax", "xb"], ["xa"]),
    "keywords_without_type": ({"minimum": 3}, [3, 4.5], [2, "a"]),
    "maxLength_without_type": ({"maxLength": 2}, ["ab"], ["abc"]),
    "unevaluatedProperties": ({"type": "object", "properties": {"a": {"type": "integer"}},
                               "unevaluatedProperties": False}, [{"a": 1}], [{"a": 1, "b": 2}]),
    "draft7_items_list": ({"type": "array", "items": [{"type": "string"}], "additionalItems": False},
                          [["a"]], [["a", 1], [1]]),
    "draft4_exclusive": ({"type": "integer", "minimum": 5, "exclusiveMinimum": True}, [6], [5]),
    "integer_bound_not_whole": ({"type": "integer", "minimum": 1.5}, [2], [1]),
    "uniqueItems_of_one": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1, "uniqueItems": True},
                           [[1], []], [[1, 1]]),
    "minProperties": ({"type": "object", "minProperties": 1}, [{"a": 1}], [{}]),
    "maxProperties": ({"type": "object", "maxProperties": 1}, [{"a": 1}], [{"a": 1, "b": 2}]),
    "recursive_ref": ({"$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["children"]}},
        "$ref": "#/$defs/node"}, [{"children": [{"children": []}]}], [{"children": [1]}]),
    "multipleOf_integer": ({"type": "integer", "multipleOf": 5, "minimum": 7, "maximum": 30}, [10, 30], [5, 11, 35]),
    "format_date": ({"type": "string", "format": "date"}, ["2024-01-31"], ["2024-1-31", "2023-02-30", "0000-01-01"]),
    "format_date_time": ({"type": "string", "format": "date-time"}, ["2024-01-31T23:59:59.5+02:00"],
                         ["2024-04-31T10:00:00Z", "2024-01-31T10:00:60Z", "2024-01-31"]),
    "format_ipv4": ({"type": "string", "format": "ipv4"}, ["10.0.0.255"], ["01.2.3.4", "256.0.0.1"]),
    "array_without_items": ({"type": "array", "maxItems": 2}, [[1, "a"], []], [[1, 2, 3]]),
    "string_length_counts_an_escape_once": ({"type": "string", "maxLength": 3}, ["a\nb", 'a"b'], ["abcd"]),
    "title_and_extension_keys_dropped": ({"type": "integer", "title": "n", "nullable": True, "x-unit": "s"}, [1], [None]),
}


@pytest.mark.parametrize("name", ENFORCED)
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not_strict"])
def test_every_keyword_kept_is_enforced_by_the_grammar(grammars, name, strict):
    schema, valid, invalid = ENFORCED[name]
    compiled = compile_json(grammars, schema, strict)
    for value in valid:
        assert accepts(compiled, dumps(value, strict)), value
    for value in invalid:
        assert not accepts(compiled, dumps(value, strict)), value
        assert not accepts(compiled, json.dumps(value, separators=(",", ":"))), value


def test_a_length_bounded_string_is_a_json_string(grammars):
    """xgrammar alone lets raw control characters into it, which no JSON parser takes."""
    compiled = compile_json(grammars, {"type": "string", "maxLength": 4})
    assert accepts(compiled, '"a\\tb"') and not accepts(compiled, '"a\x06b"') and not accepts(compiled, '"a\tb"')


REFUSED = {
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "contains": {"type": "array", "contains": {"const": "a"}},
    "minContains": {"type": "array", "minContains": 2, "contains": {"const": "a"}},
    "not": {"type": "string", "not": {"pattern": "x"}},
    "if": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    "dependentRequired": {"type": "object", "properties": {"card": {"type": "string"}, "cvv": {"type": "string"}},
                          "dependentRequired": {"card": ["cvv"]}},
    "dependentSchemas": {"type": "object", "dependentSchemas": {"card": {"required": ["cvv"]}}},
    "dependencies": {"type": "object", "dependencies": {"card": ["cvv"]}},
    "oneOf": {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]},
    "allOf": {"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]},
    "$ref": {"$ref": "https://example.com/schemas/user.json"},
    "$dynamicRef": {"$dynamicRef": "#node"},
    "multipleOf": {"type": "number", "multipleOf": 0.5},
    "minLength": {"type": "string", "pattern": "^[a-z]+$", "minLength": 3},
    "maxLength": {"type": "string", "format": "email", "maxLength": 40},
    "format": {"type": "string", "format": "phone"},
    "propertyNames": {"type": "object", "properties": {"b": {}}, "propertyNames": {"maxLength": 1}},
    "pattern": {"type": "string", "pattern": "^(?=a)\\w+$"},
}


@pytest.mark.parametrize("keyword", REFUSED)
def test_every_keyword_not_enforced_is_refused_by_name(grammars, keyword):
    nested = {"type": "object", "properties": {"outer": {"type": "array", "items": REFUSED[keyword]}}}
    for schema in (REFUSED[keyword], nested, {"$defs": {"x": REFUSED[keyword]}, "anyOf": [{"$ref": "#/$defs/x"},
                                                                                           {"type": "null"}]}):
        with pytest.raises(ValidationError) as e:
            compile_json(grammars, schema)
        assert e.value.field == "guided_decoding"
        assert e.value.message.startswith(f"JSON Schema keyword {keyword!r} is not supported"), e.value.message
    assert e.value.message.endswith("(at #/$defs/x)")


def test_where_a_refused_keyword_is_is_named():
    with pytest.raises(ValidationError, match=r"'uniqueItems' is not supported \(at #/properties/ids/items\)"):
        prepare({"type": "object", "properties": {"ids": {"type": "array", "items": {
            "type": "array", "uniqueItems": True}}}})


def test_search_patterns_become_whole_string_patterns():
    assert search_as_match("^[a-z]+$") == "[a-z]+"
    assert search_as_match("^sk-") == "sk-[\\s\\S]*"
    assert search_as_match("x\\$") == "[\\s\\S]*x\\$[\\s\\S]*"
    assert search_as_match("^a|(b|c)$") == "(a[\\s\\S]*)|([\\s\\S]*(b|c))"


def test_regex_size_counts_nested_repetitions():
    assert repetition_size("[a-z]{1,10000}") == 10000
    assert repetition_size("(([a-z]{1,30}){1,30}){1,10}") == 9000
    assert repetition_size("^\\d{3}-\\d{4}$") == 8
    assert repetition_size("\\{5000\\}[{]{2}") == 8


HOSTILE = {
    "deep_nesting": (json.loads('{"type": "object", "properties": {"a": ' * 40 + '{"type": "integer"}' + "}}" * 40),
                     "nests deeper than 32"),
    "huge_regex_repetition": ({"type": "string", "pattern": "^[a-z]{1,10000}$"}, "expand to 10000 items"),
    "nested_regex_repetition": ({"type": "string", "pattern": "^(([a-z]{1,30}){1,30}){1,10}$"}, "expand to 9000"),
    "thousands_of_properties": ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}},
                                "the schema is too large"),
    "many_properties": ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}},
                        "more than 512 properties"),
    "huge_enum": ({"enum": list(range(5000))}, "the schema is too large"),
    "allOf_chain": (json.loads('{"allOf": [' * 20 + "{}" + "]}" * 20), "more than 16 levels"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_schema_is_refused_before_it_compiles(name):
    """Refused by the walker, so xgrammar never sees it: a compiler that would fail on any compile
    (its tokenizer does not exist) reports the bound instead."""
    schema, message = HOSTILE[name]
    never = GrammarCompiler("/nonexistent", 259, (EOS,))
    start = time.perf_counter()
    with pytest.raises(ValidationError, match=message):
        never.compile({"json": json.dumps(schema)})
    assert never._compiler is None and time.perf_counter() - start < 5


@pytest.mark.parametrize("guide", [{"regex": "[a-z]{1,10000}"}, {"grammar": 'root ::= [a-z]{2000}'}])
def test_a_huge_repetition_in_a_regex_or_grammar_is_refused(guide):
    never = GrammarCompiler("/nonexistent", 259, (EOS,))
    with pytest.raises(ValidationError, match="repeats too much"):
        never.compile(guide)


def test_properties_beyond_the_schemas_cost_more_so_not_strict_allows_fewer():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(100)}}
    prepare(schema)
    with pytest.raises(ValidationError, match="more than 64 properties in all, the most supported when not strict"):
        prepare(schema, strict=False)


def test_a_compile_past_the_time_bound_is_refused_and_remembered(grammars):
    slow = GrammarCompiler(_byte_tokenizer(), 259, (EOS,), compile_timeout_s=1e-4)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "format": "email"} for i in range(40)}}
    guide = {"json": json.dumps(schema)}
    with pytest.raises(ValidationError, match="takes longer than 0.0001 s to compile"):
        slow.compile(guide)
    start = time.perf_counter()
    with pytest.raises(ValidationError, match="takes longer than"):  # remembered: refused at once
        slow.compile(guide)
    assert time.perf_counter() - start < 0.05
    slow.compile_timeout_s = 60
    assert accepts(slow.compile({"choice": ["yes", "no"]}), "yes")  # others compile on


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=6)
                    | st.sampled_from(["type", "object", "#", "#/$defs/a", "string", "^a"]),
                    lambda children: st.lists(children, max_size=4)
                    | st.dictionaries(st.sampled_from(sorted(["type", "properties", "items", "allOf", "anyOf", "oneOf",
                                                              "$ref", "$defs", "required", "enum", "const", "pattern",
                                                              "minimum", "maxItems", "additionalProperties", "a",
                                                              "not", "prefixItems", "format", "multipleOf"])),
                                      children, max_size=5),
                    max_leaves=25))
@example({"type": [[]], "allOf": [{"type": None}]})  # allOf merged types before checking them
def test_any_json_value_as_a_schema_is_prepared_or_refused_by_name(schema):
    try:
        prepare(schema)
    except ValidationError as e:
        assert e.field == "guided_decoding"
