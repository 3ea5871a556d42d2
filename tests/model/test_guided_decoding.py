"""Guided decoding in the engine: sampled outputs satisfy their JSON Schema, regex, choice or
grammar, with plain, speculative and overlapped steps; greedy constrained output is the same with
and without speculation; constrained speculative sampling follows the constrained target's
distribution (chi-square against plain sampling); a constraint that cannot compile is refused
before anything runs.

The default chat model (SmolLM2-135M-Instruct) writes the JSON; the tiny trained pair in
tests/fixtures/tiny_pair has a real draft model, so its drafts come with distributions q."""
from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import jsonschema
import pytest
from scipy.stats import chi2_contingency

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.errors import ValidationError
from backend.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "model_repository" / "llm_engine" / "1" / "target"
PAIR = REPO / "tests" / "fixtures" / "tiny_pair"
needs_default_model = pytest.mark.skipif(not (DEFAULT_MODEL / "conversion.json").is_file(),
                                         reason="run scripts/convert_default_model.py (make test does)")

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
# ten shapes; every string, number and array is bounded, so each output fits in MAX_TOKENS
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "student": {"type": "boolean"}}, "required": ["name", "age", "student"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "kind": {"const": "paint"}},
     "required": ["color", "kind"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                                       "maximum": 9999},
                                                                                "email": NAME},
                                               "required": ["id", "email"]}},
     "required": ["user"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": -99, "maximum": 99},
                                                          {"type": "string", "maxLength": 8}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"title": NAME, "note": {"type": ["string", "null"], "maxLength": 12}},
     "required": ["title", "note"], "additionalProperties": False},
    {"type": "array", "minItems": 2, "maxItems": 4, "items": {"enum": ["cat", "dog", "fish", "bird"]}},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                         "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 2, "items": NAME}},
     "required": ["ok", "tags"]},
]
MAX_TOKENS = 160
QUESTIONS = ["Describe a person as JSON.", "Give me some data.", "Answer in JSON.", "Make up an example record.",
             "What is in the box?"]


def engine(model: Path, **knobs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), **knobs))


def run(eng: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple[str, list[int], str]]:
    """(text, token ids, finish reason) of each request, in order."""
    ids = [eng.add_request(prompt, params) for prompt, params in requests]
    texts, tokens, reasons = collections.defaultdict(str), collections.defaultdict(list), {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            texts[out.request_id] += out.text
            tokens[out.request_id] += out.token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return [(texts[i], tokens[i], reasons[i]) for i in ids]


def chat_ids(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def schema_requests(tokenizer, n: int, temperature: float = 1.0) -> list[tuple[list[int], SamplingParams]]:
    return [(chat_ids(tokenizer, QUESTIONS[i % len(QUESTIONS)]),
             SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=i,
                            guided_decoding={"json": SCHEMAS[i % len(SCHEMAS)]}))
            for i in range(n)]


def assert_valid(results, n: int) -> None:
    for i, (text, _, reason) in enumerate(results):
        assert reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
    assert len(results) == n


@pytest.fixture(scope="module")
def smol():
    return engine(DEFAULT_MODEL, max_num_seqs=64)


@needs_default_model
def test_200_sampled_outputs_validate_against_their_schemas(smol):
    results = run(smol, schema_requests(smol.tokenizer, 200))
    assert_valid(results, 200)
    assert len({text for text, _, _ in results}) > 120  # sampled, not one answer per schema


@needs_default_model
@pytest.mark.parametrize("knobs", [dict(speculative_method="ngram", adaptive_speculation=False),
                                   dict(async_scheduling=True)], ids=["speculative", "overlapped"])
def test_sampled_outputs_validate_with_speculation_and_overlapped_steps(knobs):
    eng = engine(DEFAULT_MODEL, max_num_seqs=64, **knobs)
    assert_valid(run(eng, schema_requests(eng.tokenizer, 60)), 60)
    if "speculative_method" in knobs:
        assert eng.stats().spec_draft_tokens_total > 0


@needs_default_model
def test_greedy_constrained_output_is_the_same_with_speculation(smol):
    requests = schema_requests(smol.tokenizer, 10, temperature=0.0)
    plain = run(smol, requests)
    assert_valid(plain, 10)
    # the shipped EAGLE head: drafts cheap to make, some accepted and some not, so the grammar's
    # state follows accepted drafts and rolls back past rejected ones
    spec = engine(DEFAULT_MODEL, speculative_method="eagle", draft_model=str(DEFAULT_MODEL.parent / "eagle"),
                  adaptive_speculation=False, num_speculative_tokens=3)
    assert run(spec, requests) == plain
    stats = spec.stats()
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total


GUIDES = [{"regex": r"(def|class) [a-z_]{1,12}\(\)"}, {"choice": ["import os", "import sys", 'x = "\\n"', "π ≈ 3.14"]},
          {"grammar": 'root ::= "x = " num\nnum ::= [1-9] [0-9]{0,5}'}, {"json_object": True}]
MATCHES = [lambda t: re.fullmatch(r"(def|class) [a-z_]{1,12}\(\)", t),
           lambda t: t in ("import os", "import sys", 'x = "\\n"', "π ≈ 3.14"),
           lambda t: re.fullmatch(r"x = [1-9][0-9]{0,5}", t),
           lambda t: isinstance(json.loads(t), dict)]


@pytest.mark.parametrize("knobs", [{}, dict(speculative_method="draft", draft_model=str(PAIR / "draft"),
                                            adaptive_speculation=False),
                                   dict(async_scheduling=True)], ids=["plain", "draft", "overlapped"])
def test_regex_choice_grammar_and_json_object_on_the_tiny_pair(knobs):
    eng = engine(PAIR / "target", **knobs)
    prompt = eng.tokenizer("def main():\n    ").input_ids
    requests = [(prompt, SamplingParams(max_tokens=200, temperature=1.0 if i >= 4 else 0.0, seed=i,
                                        guided_decoding=GUIDES[i % 4])) for i in range(24)]
    results = run(eng, requests)
    for i, (text, _, reason) in enumerate(results):
        assert reason == "stop" and MATCHES[i % 4](text), (i, text, reason)


def test_greedy_constrained_output_is_the_same_with_the_tiny_draft():
    plain = engine(PAIR / "target")
    spec = engine(PAIR / "target", speculative_method="draft", draft_model=str(PAIR / "draft"),
                  adaptive_speculation=False)
    prompt = plain.tokenizer("import os\n\ndef ").input_ids
    requests = [(prompt, SamplingParams(max_tokens=200, temperature=0.0, guided_decoding=g)) for g in GUIDES]
    assert run(spec, requests) == run(plain, requests)
    assert spec.stats().spec_accepted_tokens_total > 0


def test_constrained_speculative_sampling_matches_constrained_plain_sampling():
    """Two-sample chi-square over the outputs of a small grammar (16 strings), T = 1: plain
    sampling against draft-model speculation, whose drafts the grammar often forbids."""
    guide = {"regex": "[a-d][0-3]"}
    counts = []
    for knobs in ({}, dict(speculative_method="draft", draft_model=str(PAIR / "draft"), adaptive_speculation=False,
                           num_speculative_tokens=2)):
        eng = engine(PAIR / "target", max_num_seqs=128, **knobs)
        prompt = eng.tokenizer("x = ").input_ids
        results = run(eng, [(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=i, guided_decoding=guide))
                            for i in range(1500)])
        assert all(re.fullmatch("[a-d][0-3]", text) for text, _, _ in results)
        counts.append(collections.Counter(text for text, _, _ in results))
        if knobs:
            assert eng.stats().spec_draft_tokens_total > 0
    outcomes = sorted(set(counts[0]) | set(counts[1]))
    table = [[c[o] for o in outcomes] for c in counts]
    assert len(outcomes) >= 8
    assert chi2_contingency(table).pvalue > 1e-3, (outcomes, table)


@pytest.mark.parametrize("guide,message", [
    ({"json": "{not json"}, "json is not valid JSON"),
    ({"json": '{"type": "nonsense"}'}, 'json does not compile: Unsupported type "nonsense"'),
    ({"regex": "[^\\s\\S]"}, "regex matches no output"),
    ({"regex": "[a-"}, "regex does not compile"),
    ({"grammar": 'root ::= "a" |'}, "grammar does not compile"),
    ({"grammar": 'start ::= "a"'}, 'The root rule with name "root" is not found'),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"choice": []}, "choice must be 1 to"),
    ({"json_object": "yes"}, "json_object must be true"),
    ({"backend": "outlines", "regex": "a"}, "backend must be one of"),
])
def test_a_constraint_that_cannot_compile_is_refused_before_anything_runs(guide, message):
    eng = engine(PAIR / "target")
    with pytest.raises(ValidationError) as e:
        eng.validate([5, 6], SamplingParams(guided_decoding=guide))
    assert e.value.field == "guided_decoding" and message in e.value.message
    assert not eng.requests
    # the engine serves on, constraints included
    assert run(eng, [([5, 6], SamplingParams(max_tokens=8, guided_decoding={"choice": ["yes", "no"]}))])[0][0] in (
        "yes", "no")


def test_a_compiled_constraint_is_cached_by_its_text():
    eng = engine(PAIR / "target")
    params = SamplingParams(guided_decoding={"json": SCHEMAS[0]})
    eng.validate([5], params)
    misses = eng.grammars.misses
    eng.validate([5], SamplingParams(guided_decoding={"json": json.dumps(SCHEMAS[0])}))  # the same text
    assert (eng.grammars.misses, eng.grammars.hits) == (misses, 1)


def test_unconstrained_rows_pay_nothing():
    """A step without constrained requests builds no bitmask; a mixed one masks only the
    constrained rows."""
    from backend.sample.sampling_metadata import build_sampling_metadata

    eng = engine(PAIR / "target")
    eng.add_request([5, 6], SamplingParams(max_tokens=4, temperature=1.0))
    eng.add_request([5, 6], SamplingParams(max_tokens=4, guided_decoding={"choice": ["ab"]}))
    plain, constrained = eng.requests.values()
    meta = build_sampling_metadata([plain, plain], [[], [7, 8]], eng.vocab_size, eng.sampler.generator, eng.device)
    assert meta.grammar_bitmask is None
    meta = build_sampling_metadata([plain, constrained], [[7], []], eng.vocab_size, eng.sampler.generator, eng.device)
    assert meta.grammar_rows == [2]
    allowed = [t for t in range(eng.vocab_size) if meta.grammar_bitmask[2, t // 32] >> (t % 32) & 1]
    assert allowed and all(eng.tokenizer.decode([t]) and "ab".startswith(eng.tokenizer.decode([t])) for t in allowed)


def test_guided_decoding_cannot_be_combined_with_ignore_eos_or_min_tokens():
    for extra in (dict(ignore_eos=True), dict(min_tokens=2)):
        with pytest.raises(ValidationError, match="cannot be combined"):
            SamplingParams(guided_decoding={"regex": "a+"}, **extra)


def test_a_constraint_compiles_in_the_submitting_thread_not_in_a_step():
    """EngineLoop.submit compiles (or refuses) before the engine thread sees the request; the
    engine thread's add_request finds it cached."""
    from backend.engine_loop import EngineLoop

    eng = engine(PAIR / "target")
    loop = EngineLoop(eng)  # not started: nothing runs on an engine thread
    with pytest.raises(ValidationError, match="regex does not compile"):
        loop.submit([5, 6], SamplingParams(guided_decoding={"regex": "[a-"}), lambda out: None)
    loop.submit([5, 6], SamplingParams(max_tokens=4, guided_decoding={"json": SCHEMAS[1]}), lambda out: None)
    assert eng.grammars.misses == 1 and not eng.requests
    outputs = []
    loop.start()
    loop.submit([5, 6], SamplingParams(max_tokens=40, guided_decoding={"json": SCHEMAS[1]}), outputs.append)
    loop.shutdown()
    assert eng.grammars.misses == 1 and eng.grammars.hits >= 2


def test_seeded_constrained_output_is_the_same_with_the_tiny_draft_and_overlapped_steps():
    """A seed fixes a constrained sampled text too: the same with plain steps, the draft at k = 3
    and adaptive k, and overlapped steps."""
    variants = [{}, dict(speculative_method="draft", draft_model=str(PAIR / "draft"), adaptive_speculation=False,
                         num_speculative_tokens=3),
                dict(speculative_method="draft", draft_model=str(PAIR / "draft")), dict(async_scheduling=True)]
    results = []
    for knobs in variants:
        eng = engine(PAIR / "target", **knobs)
        prompt = eng.tokenizer("def main():\n    ").input_ids
        results.append(run(eng, [(prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=100 + i,
                                                         guided_decoding=GUIDES[i % 4])) for i in range(8)]))
    assert all(r == results[0] for r in results[1:])
    assert len({text for text, _, _ in results[0]}) > 4
