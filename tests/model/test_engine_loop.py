"""EngineLoop.build: the engine is built on the thread that steps it (the CPU's OpenMP runtime
stops letting idle workers spin once two threads have worker pools, and every parallel operation
of a step then waits for a sleeping worker), serves as an engine stepped in this thread does, and
a build that fails raises its error to the caller. batch_wait_ms: an idle engine gathers a burst
into its first step, within its limits."""
import threading
import time

import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.engine_loop import EngineLoop
from backend.errors import ValidationError
from backend.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_a_built_loop_builds_and_steps_its_engine_on_one_thread(tiny_llama):
    built_on: list[int] = []
    stepped_on: set[int] = set()

    def make_engine() -> LLMEngine:
        built_on.append(threading.get_ident())
        engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, num_threads=2))
        step = engine.step

        def recorded_step():
            stepped_on.add(threading.get_ident())
            return step()

        engine.step = recorded_step
        return engine

    loop = EngineLoop.build(make_engine)
    loop.start()  # a built loop runs already: starting it again changes nothing
    tokens: dict[str, list[int]] = {}
    done = threading.Event()

    def on_output(output):
        tokens.setdefault(output.request_id, []).extend(output.token_ids)
        if output.finished and len([1 for t in tokens.values() if len(t) == 12]) == len(PROMPTS):
            done.set()

    ids = [loop.submit(prompt, greedy(12), on_output) for prompt in PROMPTS]
    try:
        assert done.wait(60)
    finally:
        loop.shutdown()
    assert built_on[0] != threading.get_ident()
    assert stepped_on == set(built_on)

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, num_threads=2))
    expected = {}
    for prompt in PROMPTS:
        rid = engine.add_request(prompt, greedy(12))
        while engine.has_unfinished_requests():
            for out in engine.step():
                expected.setdefault(out.request_id, []).extend(out.token_ids)
        assert len(expected[rid]) == 12
    assert [tokens[i] for i in ids] == [expected[rid] for rid in expected]


def test_a_build_that_fails_raises_its_error(tiny_llama):
    def make_engine() -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, max_num_seqs=0))

    with pytest.raises(ValidationError, match="max_num_seqs"):
        EngineLoop.build(make_engine)


def first_step_requests(tiny_llama, batch_wait_ms: float, gaps: list[float], **config) -> tuple[int, float]:
    """Requests submitted with `gaps` seconds between them to an idle loop: how many the engine
    held when its first step began, and the seconds from the first submit to that step."""
    seen: list[tuple[int, float]] = []

    def make_engine() -> LLMEngine:
        engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=8, batch_wait_ms=batch_wait_ms, **config))
        step = engine.step

        def recorded_step():
            seen.append((len(engine.requests), time.monotonic()))
            return step()

        engine.step = recorded_step
        return engine

    loop = EngineLoop.build(make_engine)
    finished = threading.Semaphore(0)
    try:
        start = time.monotonic()
        for i, gap in enumerate([0.0, *gaps]):
            time.sleep(gap)
            loop.submit(PROMPTS[i % len(PROMPTS)], greedy(2), lambda out: out.finished and finished.release())
        for _ in range(len(gaps) + 1):
            assert finished.acquire(timeout=60)
    finally:
        loop.shutdown()
    return seen[0][0], seen[0][1] - start


def test_an_idle_engine_steps_at_once_without_batch_wait(tiny_llama):
    assert first_step_requests(tiny_llama, 0, [0.15, 0.15])[0] == 1


def test_batch_wait_gathers_a_burst_into_the_first_step(tiny_llama):
    # each request arrives within the 100 ms gap of the last: one step takes all three
    requests, waited = first_step_requests(tiny_llama, 100, [0.02, 0.02])
    assert requests == 3 and waited >= 0.14  # the last arrived at 0.04 s, then a quiet 0.1 s


def test_batch_wait_ends_when_a_step_is_full_or_at_its_limit(tiny_llama):
    # max_num_seqs 2: the wait ends with the second request, before the third comes
    assert first_step_requests(tiny_llama, 100, [0.0, 0.3], max_num_seqs=2)[0] == 2
    # requests that never stop coming are cut off at BATCH_WAITS gaps (8 x 20 ms)
    requests, waited = first_step_requests(tiny_llama, 20, [0.01] * 40)
    assert requests < 35 and waited < 1.0


def test_batch_wait_is_bounded():
    with pytest.raises(ValidationError, match="batch_wait_ms"):
        EngineConfig(model=".", batch_wait_ms=-1)
