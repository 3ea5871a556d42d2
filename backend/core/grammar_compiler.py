"""Guided decoding's constraints compiled into token-level grammars (xgrammar), once per text.

A request's `guided_decoding` (backend/sampling_params.py: {kind: text}) becomes an xgrammar
CompiledGrammar over the target's vocabulary: for any prefix of the output, the set of tokens that
keep it a prefix of a string the constraint accepts, and whether the output may end there (the
engine's EOS tokens are the grammar's stop tokens: EOS is allowed only where the grammar can end).

    json         a JSON Schema, every keyword enforced or refused (backend/core/json_schema.py);
                 strict: compact (", " and ": "), properties in the schema's order, none beyond
                 the schema's unless it says so (additionalProperties); with `"x-strict": false`
                 at its root: JSON Schema's own reading, properties beyond the schema's allowed
                 where it does not forbid them, and whitespace free (runs of MAX_WHITESPACE at most)
    json_object  any JSON object, compact (as a strict schema; `{"type": "object", "x-strict": false}`
                 as `json` reads any JSON object, whitespace free)
    regex        a regular expression the whole output matches
    choice       one of the strings, exactly
    grammar      an EBNF grammar (GBNF, xgrammar's dialect) whose rule `root` the output matches

Compiled grammars are cached by (kind, text): the same schema sent again compiles in microseconds.
`compile` runs where a request arrives (EngineLoop.submit, in the caller's thread), never in a
step: a cold JSON Schema takes some 20 ms, which would stall every request in the batch.
A constraint that does not compile (a schema that is not one, a keyword that cannot be enforced,
a regex or grammar with a syntax error, a regex no string matches) is a ValidationError naming
`guided_decoding`. So is one past the bounds on what compiling may cost: its size, nesting and
regex repetition counts (json_schema_limits.SchemaLimits), checked before compiling, and the time
compiling takes (compile_timeout_s; xgrammar cannot be stopped, so one compiling thread runs them
in turn, and a constraint that ran past the bound is remembered and refused at once thereafter).
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import re
import threading
from typing import Any

import xgrammar

from backend.core.json_schema import STRICT_KEY, prepare
from backend.core.json_schema_limits import SchemaLimits, check_repetitions
from backend.core.json_schema_order import in_schema_order
from backend.errors import ValidationError

CACHE_SIZE = 256  # compiled grammars kept (least recently used first out)
COMPILE_TIMEOUT_S = 5.0  # a constraint that takes longer to compile is refused
MAX_WHITESPACE = 24  # whitespace characters in a row where JSON's whitespace is free


class GrammarCompiler:
    """`tokenizer`: the target's (or its directory, loaded on first use). The vocabulary is read
    on the first compile (a few hundred ms), so engines that never see a constraint pay nothing."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int] | tuple[int, ...],
                 cache_size: int = CACHE_SIZE, compile_timeout_s: float = COMPILE_TIMEOUT_S,
                 limits: SchemaLimits = SchemaLimits()):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self.cache: collections.OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = collections.OrderedDict()
        self.too_slow: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()  # ran past the bound
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self.limits = limits
        self.lock = threading.Lock()
        self.hits = self.misses = 0
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    @property
    def compiler(self) -> xgrammar.GrammarCompiler:
        with self.lock:
            if self._compiler is None:
                tokenizer = self.tokenizer
                if isinstance(tokenizer, str):
                    from transformers import AutoTokenizer
                    tokenizer = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_token_ids)
                # one compiling thread: compilation shares the host with the engine's steps
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, guide: dict) -> xgrammar.CompiledGrammar:
        """The compiled grammar of a validated `guided_decoding` ({kind: value})."""
        (kind, value), = guide.items()
        key = (kind, value if isinstance(value, str) else json.dumps(value))
        with self.lock:
            compiled = self.cache.get(key)
            if compiled is not None:
                self.cache.move_to_end(key)
                self.hits += 1
                return compiled
            if key in self.too_slow:
                raise self._timeout_error(kind)
        try:
            value, options = self._check(kind, value)
        except RecursionError:
            raise ValidationError("guided_decoding", f"{kind} nests too deeply") from None
        compiled = self._compile_bounded(kind, value, options, key)  # outside the lock: others' hits do not wait
        with self.lock:
            self.misses += 1
            self.cache[key] = compiled
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return compiled

    def _check(self, kind: str, value) -> tuple[object, dict]:
        """What is compiled for a constraint, with xgrammar's JSON options; ValidationError for
        one that cannot be enforced or is past self.limits."""
        if kind == "json_object":
            return '{"type": "object"}', _STRICT_JSON
        if kind in ("regex", "grammar"):
            check_repetitions(value, kind, self.limits)
        if kind != "json":
            return value, {}
        schema = json.loads(value)
        strict = schema.pop(STRICT_KEY, True) if isinstance(schema, dict) else True
        if not isinstance(strict, bool):
            raise ValidationError("guided_decoding", f"{STRICT_KEY} must be true or false, got {strict!r}")
        return json.dumps(prepare(schema, self.limits, strict)), _STRICT_JSON if strict else _FREE_JSON

    def _compile_bounded(self, kind: str, value, options: dict, key: tuple[str, str]) -> xgrammar.CompiledGrammar:
        """_compile on the compiling thread, waited for compile_timeout_s at most."""
        future = self._worker.submit(self._compile, kind, value, options)
        try:
            return future.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()  # if it has not started; otherwise it runs on, and its grammar is dropped
            with self.lock:
                self.too_slow[key] = None
                while len(self.too_slow) > self.cache_size:
                    self.too_slow.popitem(last=False)
            raise self._timeout_error(kind) from None

    def _timeout_error(self, kind: str) -> ValidationError:
        return ValidationError("guided_decoding", f"{kind} takes longer than {self.compile_timeout_s:g} s to compile; "
                                                  "a smaller one may not")

    def _compile(self, kind: str, value, options: dict) -> xgrammar.CompiledGrammar:
        try:
            if kind in ("json", "json_object"):
                compiled = self.compiler.compile_grammar(json_grammar(value, options))
            elif kind == "regex":
                compiled = self.compiler.compile_regex(value)
            elif kind == "choice":
                compiled = self.compiler.compile_grammar(choice_grammar(value))
            else:
                compiled = self.compiler.compile_grammar(value, root_rule_name="root")
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValidationError("guided_decoding", f"{kind} does not compile: {_first_line(e)}") from None
        if _matches_nothing(compiled):
            raise ValidationError("guided_decoding", f"{kind} matches no output")
        return compiled


def json_grammar(schema: str, options: dict) -> xgrammar.Grammar | str:
    """xgrammar's grammar for a JSON Schema, with one repair: a string with minLength or maxLength
    is written character by character, and xgrammar (0.2.9) lets those characters be raw control
    characters (invalid JSON) and no escapes; here they are JSON's string characters, an escape
    counting as one."""
    grammar = xgrammar.Grammar.from_json_schema(schema, **options)
    text = str(grammar)
    repaired = _LENGTH_CHARACTERS.sub(lambda match: match.group(1) + _JSON_CHARACTER, text)
    return repaired if repaired != text else grammar


_LENGTH_CHARACTERS = re.compile(r'^(\w+_characters ::= )\(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHARACTER = r'(([^\0-\x1f\"\\]) | ("\\" ([\"\\/bfnrt] | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))))'
_STRICT_JSON = dict(any_whitespace=False, strict_mode=True)
_FREE_JSON = dict(any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE, strict_mode=False)


class JsonChecker:
    """Whether a JSON value satisfies a schema, by the grammar a `json` constraint compiles for it
    (read as JSON Schema reads it: `"x-strict": false`), matched over a byte vocabulary, so no
    tokenizer is needed: a tool call's arguments, checked the way a forced call is constrained.
    ValidationError for a schema with a keyword that cannot be enforced."""

    def __init__(self, schema: Any):
        self.schema = prepare(schema, _CHECK_LIMITS, strict=False)
        try:
            self.compiled = _byte_compiler().compile_grammar(json_grammar(json.dumps(self.schema), _FREE_JSON))
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValidationError("guided_decoding", f"json does not compile: {_first_line(e)}") from None

    def matches(self, value: Any) -> bool:
        text = json.dumps(in_schema_order(value, self.schema), ensure_ascii=False)
        matcher = xgrammar.GrammarMatcher(self.compiled, terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_terminated()


@functools.lru_cache(maxsize=CACHE_SIZE)
def json_checker(schema_text: str) -> JsonChecker:
    """The JsonChecker of a schema's JSON text, kept for the next request with the same schema."""
    return JsonChecker(json.loads(schema_text))


@functools.cache
def _byte_compiler() -> xgrammar.GrammarCompiler:
    info = xgrammar.TokenizerInfo([bytes([i]) for i in range(256)])
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


# checking costs far less than constraining a 50k-token vocabulary: properties as many as strict allows
_CHECK_LIMITS = SchemaLimits(max_free_properties=SchemaLimits().max_properties)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar accepting exactly one of `choices`."""
    return "root ::= " + " | ".join(_ebnf_string(c) for c in choices)


def _ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal: quotes and backslashes escaped, control and non-ASCII
    characters as \\uXXXX."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif 32 <= ord(ch) < 127:
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


def _matches_nothing(compiled: xgrammar.CompiledGrammar) -> bool:
    """No token, and not the end either, is allowed at the start: no output can satisfy it."""
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return not bool(bitmask.any())


def _first_line(error: Exception) -> str:
    """The library's message, without its time stamp and source location."""
    lines = str(error).strip().splitlines()
    return _LOCATION.sub("", lines[0] if lines else type(error).__name__)[:300]


_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # "[13:13:46] /project/cpp/regex_converter.cc:83: "
