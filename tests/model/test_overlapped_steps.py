"""Overlapped steps (async scheduling) give what plain steps give: the same tokens, text, finish
reasons and logprobs, through stops, EOS, length limits, penalties, seeds, preemption and aborts,
with every block back in the pool at the end. On a CPU the overlap gains nothing, but the
bookkeeping (inputs taken from last step's device tokens, wasted rows, one-step-late outputs) is
the same code that runs on a GPU."""
import random
from pathlib import Path

import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams

TARGET = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_pair" / "target"  # a small trained model


def requests(seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of code-like tokens; greedy and seeded sampling, penalties, logprobs, stops."""
    rng = random.Random(seed)
    out = []
    for i in range(14):
        prompt = [rng.randrange(3, 8000) for _ in range(rng.randint(4, 70))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 48),
            temperature=0.0 if i % 2 else 0.8,
            top_p=0.9 if i % 5 == 1 else 1.0,
            seed=100 + i,
            logprobs=2 if i % 3 == 0 else None,
            repetition_penalty=1.3 if i % 4 == 0 else 1.0,
            min_tokens=3 if i % 7 == 0 else 0,
            stop=["\n"] if i % 6 == 2 else [],
            stop_token_ids=[39] if i == 5 else [],
        )
        out.append((prompt, params))
    return out


def run(async_scheduling: bool, abort_after: dict[str, int] | None = None, **knobs) -> tuple[dict, LLMEngine]:
    config = dict(model=str(TARGET), max_num_seqs=6, max_num_batched_tokens=48, block_size=16, num_kv_blocks=256)
    config.update(knobs)
    engine = LLMEngine(EngineConfig(**config, async_scheduling=async_scheduling))
    for i, (prompt, params) in enumerate(requests()):
        engine.add_request(prompt, params, request_id=f"r{i}")
    results: dict[str, dict] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "text": "", "logprobs": [], "reason": None})
            r["tokens"] += out.token_ids
            r["text"] += out.text
            r["logprobs"] += out.logprobs or []
            r["reason"] = out.finish_reason
        for request_id, after in (abort_after or {}).items():
            if request_id in engine.requests and len(results.get(request_id, {}).get("tokens", [])) >= after:
                final = engine.abort(request_id)
                results[request_id]["reason"] = final.finish_reason
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert not engine.requests and not engine.in_flight
    return results, engine


def assert_same(plain: dict, overlapped: dict) -> None:
    assert plain.keys() == overlapped.keys()
    for request_id, want in plain.items():
        got = overlapped[request_id]
        assert got["tokens"] == want["tokens"], request_id
        assert got["text"] == want["text"] and got["reason"] == want["reason"], request_id
        assert len(got["logprobs"]) == len(want["logprobs"])
        for a, b in zip(got["logprobs"], want["logprobs"]):  # batch shapes differ: float noise only
            assert a["token_id"] == b["token_id"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
            assert a["top"].keys() == b["top"].keys()


def test_overlapped_steps_match_plain_steps():
    plain, _ = run(False)
    overlapped, engine = run(True)
    assert engine.overlap
    assert_same(plain, overlapped)
    reasons = {r["reason"] for r in plain.values()}
    assert reasons == {"stop", "length"}  # stops (EOS, stop string, stop token) and length limits both met


def test_overlapped_steps_match_plain_steps_under_preemption():
    plain, before = run(False, num_kv_blocks=12)
    overlapped, engine = run(True, num_kv_blocks=12)
    assert before.scheduler.num_preemptions > 0 and engine.scheduler.num_preemptions > 0
    assert_same(plain, overlapped)


def test_abort_while_a_token_is_in_flight():
    """An aborted request's in-flight token is dropped; the others are unharmed."""
    plain, _ = run(False)
    overlapped, _ = run(True, abort_after={"r1": 2, "r3": 1})
    for request_id in ("r1", "r3"):
        got = overlapped.pop(request_id)
        assert got["reason"] == "abort"
        assert got["tokens"] == plain.pop(request_id)["tokens"][: len(got["tokens"])]
    assert_same(plain, overlapped)


def test_speculating_engines_overlap_steps_only_when_asked():
    engine = LLMEngine(EngineConfig(model=str(TARGET), speculative_method="ngram", num_kv_blocks=16))
    assert not engine.overlap  # the default (None) leaves speculating engines on plain steps
    assert engine.speculator.control.adaptive
    engine = LLMEngine(EngineConfig(model=str(TARGET), speculative_method="ngram", num_kv_blocks=16,
                                    async_scheduling=True))
    assert engine.overlap
    assert engine.speculator.control.adaptive  # each step is timed on the device's clock, read after its read-back


def test_request_done_by_length_is_not_scheduled_again():
    """A request whose in-flight token reaches max_tokens has nothing left to compute: with EOS
    ignored, overlapped steps compute exactly the tokens plain steps do, up to the last position
    of the context."""
    computed = {}
    for async_scheduling in (False, True):
        engine = LLMEngine(EngineConfig(model=str(TARGET), max_model_len=64, num_kv_blocks=16,
                                        async_scheduling=async_scheduling))
        schedule, batches = engine.scheduler.schedule, []

        def counted_schedule(*args, schedule=schedule, batches=batches):
            batches.append(schedule(*args))
            return batches[-1]

        engine.scheduler.schedule = counted_schedule
        engine.add_request(list(range(3, 53)), SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
        engine.add_request(list(range(3, 20)), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step() for t in out.token_ids]
        assert len(tokens) == 19 and engine.block_manager.num_free_blocks == engine.num_blocks
        computed[async_scheduling] = sum(batch.total_tokens for batch in batches)
    assert computed[True] == computed[False] == 50 + 13 + 17 + 4


@pytest.mark.parametrize("async_scheduling, depth", [(False, 1), (True, 2)])
def test_one_step_path_keeps_depth_minus_one_steps_in_flight(async_scheduling, depth):
    """Plain decoding reads each step back within it; overlapped steps leave the one just launched
    in flight, sampled on the device (the next step reads its tokens there)."""
    engine = LLMEngine(EngineConfig(model=str(TARGET), num_kv_blocks=16, async_scheduling=async_scheduling))
    assert engine.depth == depth
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    queued, tokens = [], []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.token_ids]
        queued.append([s.sampled for s in engine.in_flight])
    assert len(tokens) == 6
    assert queued == [[]] * 6 if depth == 1 else queued == [[True]] * 6 + [[]]
