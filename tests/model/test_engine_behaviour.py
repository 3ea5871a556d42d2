"""Engine behaviour beyond greedy equality: seeds, stops, aborts, validation, accounting."""
import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.errors import ValidationError
from backend.sampling_params import SamplingParams


@pytest.fixture
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8))


def drain(engine) -> dict:
    results: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "text": "", "final": None, "n": 0})
            r["tokens"] += out.token_ids
            r["text"] += out.text
            r["n"] += 1
            if out.finished:
                r["final"] = out
    return results


def test_seeded_request_same_alone_and_in_batch(engine):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    rid = engine.add_request(prompt, params)
    alone = drain(engine)[rid]["tokens"]
    ids = [engine.add_request([9 + i] * (3 + i), SamplingParams(max_tokens=20, temperature=1.0)) for i in range(7)]
    rid = engine.add_request(prompt, params)
    ids += [engine.add_request([40 + i] * (5 + 2 * i), SamplingParams(max_tokens=30, top_k=5)) for i in range(7)]
    assert drain(engine)[rid]["tokens"] == alone


def test_max_tokens_and_counts(engine):
    rid = engine.add_request([10, 11, 12], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    final = drain(engine)[rid]
    assert len(final["tokens"]) == 7
    assert final["final"].finish_reason == "length"
    assert final["final"].num_prompt_tokens == 3 and final["final"].num_output_tokens == 7


def test_stop_token_id_ends_request(engine):
    rid = engine.add_request([10, 11, 12], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    tokens = drain(engine)[rid]["tokens"]
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    rid = engine.add_request(
        [10, 11, 12], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at])
    )
    result = drain(engine)[rid]
    assert result["tokens"] == tokens[: first + 1] and result["final"].finish_reason == "stop"


def test_stop_string_cuts_text(engine):
    rid = engine.add_request([10, 11, 12], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    text = drain(engine)[rid]["text"]
    stop = text[5:7]
    rid = engine.add_request([10, 11, 12], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop]))
    result = drain(engine)[rid]
    assert result["text"] == text[: text.index(stop)] and result["final"].finish_reason == "stop"


def test_abort_frees_blocks_and_others_continue(engine):
    a = engine.add_request(list(range(5, 45)), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    b = engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    early = [t for _ in range(2) for o in engine.step() if o.request_id == b for t in o.token_ids]
    out = engine.abort(a)
    assert out.finished and out.finish_reason == "abort"
    results = drain(engine)
    assert len(early + results[b]["tokens"]) == 10 and a not in results
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert engine.abort("no-such-request") is None


@pytest.mark.parametrize(
    "prompt,kwargs,field",
    [
        ([], {}, "prompt_token_ids"),
        (list(range(3, 259)) * 2, {}, "prompt_token_ids"),  # 512 tokens: the whole context
        ([5] * 500, {"max_tokens": 20}, "max_tokens"),
        ([999], {}, "prompt_token_ids"),
    ],
)
def test_bad_requests_raise_and_engine_keeps_serving(engine, prompt, kwargs, field):
    with pytest.raises(ValidationError) as e:
        engine.add_request(prompt, SamplingParams(**kwargs))
    assert e.value.field == field
    rid = engine.add_request([5, 6], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(drain(engine)[rid]["tokens"]) == 3


def test_logprobs_returned_per_token(engine):
    engine.add_request([5, 6], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    tokens = [t for o in outs for t in o.token_ids]
    assert [lp["token_id"] for lp in lps] == tokens
    assert all(len(lp["top"]) == 3 and max(lp["top"].values()) == lp["logprob"] for lp in lps)


@pytest.mark.parametrize("stop_at", [None, 5])
def test_each_outputs_logprob_entries_spell_its_text(engine, stop_at):
    """At max_tokens and at a stop string (whose tokens keep their entries, spelling only the
    text before it), every output's chosen tokens spell that output's text."""
    params = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True, "logprobs": 2}
    rid = engine.add_request([10, 11, 12], SamplingParams(**params))
    text = drain(engine)[rid]["text"]
    stop = [text[stop_at : stop_at + 2]] if stop_at else []
    rid = engine.add_request([10, 11, 12], SamplingParams(**params, stop=stop))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    for out in outs:
        entries = out.logprobs or []
        assert [lp["token_id"] for lp in entries] == out.token_ids
        assert "".join(lp["text"][lp["token_id"]] for lp in entries) == out.text
    assert "".join(o.text for o in outs) == (text[: text.index(stop[0])] if stop else text)
    assert outs[-1].finish_reason == ("stop" if stop else "length")
    assert outs[-1].cumulative_logprob == pytest.approx(sum(lp["logprob"] for o in outs for lp in o.logprobs or []))
