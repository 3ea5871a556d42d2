"""Adaptive speculation: k from measured survival and costs (the on/off choice: test_mode_chooser.py)."""
import json
from pathlib import Path

import numpy as np
import pytest

from backend.core.request import Request
from backend.sampling_params import SamplingParams
from backend.speculative.mode_chooser import MAX_EXPLORE_EVERY
from backend.speculative.spec_control import REQUEST_MEMORY, LinearCost, SpecControl, Survival


def _own_survival(c: SpecControl, rid: str) -> Survival:
    return c.survival.setdefault(rid, Survival(c.max_k, REQUEST_MEMORY))


def _requests(c: SpecControl, n: int, a: float, verifications: int = 200) -> list[str]:
    """n requests whose every verification so far accepted each draft token with rate a, counted
    in expectation (survival a^i), the batch's curve the same."""
    ids = [str(i) for i in range(n)]
    curve = a ** np.arange(1, c.max_k + 1)
    for survival in [c.batch_survival] + [_own_survival(c, rid) for rid in ids]:
        survival.reached[:] = verifications
        survival.survived[:] = verifications * curve
    return ids


def _ks(c: SpecControl, ids: list[str]) -> list[int]:
    return c.choose_k(ids)[0]


def _controller(target_t0, target_t1, draft_t0):
    c = SpecControl(max_k=4)
    for n in (1, 64, 128):
        c.target_cost.add(n, target_t0 + target_t1 * n)
        c.draft_first_cost.add(n, draft_t0)
        c.draft_cost.add(n, draft_t0)
    return c


def test_good_draft_on_a_memory_bound_target_speculates():
    c = _controller(target_t0=0.010, target_t1=0.0, draft_t0=0.001)
    assert _ks(c, _requests(c, 1, 0.8)) == [4]


def test_compute_bound_target_at_large_batch_turns_speculation_off():
    # every extra token costs as much as a request's whole decode: verification cannot pay
    c = _controller(target_t0=0.0, target_t1=0.001, draft_t0=0.002)
    assert _ks(c, _requests(c, 64, 0.5)) == [0] * 64


def test_poor_acceptance_turns_speculation_off():
    c = _controller(target_t0=0.010, target_t1=0.0, draft_t0=0.004)
    assert _ks(c, _requests(c, 4, 0.05)) == [0] * 4


def test_free_drafts_need_only_the_target_cost():
    """An n-gram proposer costs nothing to run: its plans come from the target's costs alone."""
    c = SpecControl(max_k=4, free_drafts=True)
    for n in (1, 5):
        c.target_cost.add(n, 0.010)  # verification is free on this target
    assert _ks(c, _requests(c, 1, 0.3)) == [4]
    busy = SpecControl(max_k=4, free_drafts=True)
    for n in (64, 320):
        busy.target_cost.add(n, n * 0.001)  # every verified token costs a decode's share
    assert _ks(busy, _requests(busy, 64, 0.3)) == [0] * 64


def test_expected_tokens_follow_the_measured_survival_not_a_geometric_guess():
    """Accepting the first token makes the next likelier: the curve says so, one rate cannot."""
    c = SpecControl(max_k=4)
    (rid,) = _requests(c, 1, 0.5)
    own = c.survival[rid]
    own.reached[:], own.survived[:] = 1000, [600, 500, 450, 420]
    assert c.expected_yields([rid])[0] == pytest.approx([1, 1.6, 2.1, 2.55, 2.97], abs=0.01)


def test_a_new_request_starts_from_the_batch_curve():
    c = SpecControl(max_k=3)
    _requests(c, 2, 0.9, verifications=400)
    assert c.expected_yields(["new"])[0] == pytest.approx(1 + np.cumsum([1, 0.9, 0.9**2, 0.9**3]) - 1, abs=0.01)


def test_a_costly_first_draft_forward_favours_longer_drafts():
    """The first draft forward of a step carries a fixed cost (catch-up, set-up); spreading it
    over more draft tokens pays, which one per-forward average cannot see."""
    def controller(first, further):
        c = SpecControl(max_k=4)
        for n in (1, 8):
            c.target_cost.add(n, 0.010)
            c.draft_first_cost.add(n, first)
            c.draft_cost.add(n, further)
        return c

    even, front_loaded = controller(0.003, 0.003), controller(0.006, 0.001)
    assert _ks(even, _requests(even, 1, 0.6)) == [1]
    assert _ks(front_loaded, _requests(front_loaded, 1, 0.6)) == [4]


def test_survival_counts_verifications_in_the_batch_and_the_request():
    c = SpecControl(max_k=3)
    c.observe_verification("r", 3, 1)  # first accepted, second rejected
    c.observe_verification("r", 2, 2)  # both accepted
    assert c.batch_survival.reached.tolist() == pytest.approx([0.99 + 1, 0.99 + 1, 0.99])
    assert c.batch_survival.survived.tolist() == pytest.approx([0.99 + 1, 1, 0])
    assert c.survival["r"].reached.tolist() == pytest.approx([0.95 + 1, 0.95 + 1, 0.95])
    assert c.survival["r"].survived.tolist() == pytest.approx([0.95 + 1, 1, 0])
    c.forget_all_but({"other"})  # the request is gone: so are its counts, not the batch's
    assert "r" not in c.survival and c.batch_survival.reached[0] > 0


def test_a_request_that_sat_out_is_tried_again():
    c = _controller(target_t0=0.010, target_t1=0.0, draft_t0=0.003)
    _requests(c, 4, 0.5)  # the batch does fairly
    for _ in range(6):
        c.observe_verification("unlucky", 3, 0)  # every first draft token rejected
    plans = [_ks(c, ["unlucky"])[0] for _ in range(30)]
    assert plans[0] == 0 and max(plans) > 0  # its counts faded toward the batch's curve


def test_linear_cost_fits_the_latest_samples_of_each_size_exactly():
    cost = LinearCost(per_size=2)
    cost.add(10, 9.0)
    assert (cost.t0, cost.t1) == (9.0, 0.0)  # one size seen: a constant
    for n in (1, 2, 3, 10, 10):  # the last two push the first sample at size 10 out ...
        cost.add(n, 0.5 + 0.25 * n)
    assert cost.t0 == pytest.approx(0.5) and cost.t1 == pytest.approx(0.25)  # ... exactly this line
    assert cost(4) == pytest.approx(1.5)  # the line, evaluated


def test_linear_cost_keeps_its_slope_through_a_long_run_at_one_size():
    """Plain decoding times the target at one size (a token per request) step after step; what
    was measured with draft tokens must still count, or verification would look free."""
    cost = LinearCost()
    for n in (32, 64, 96, 128):  # a few speculating steps
        cost.add(n, 0.01 + 0.001 * n)
    for _ in range(1000):  # then plain decoding
        cost.add(32, 0.01 + 0.001 * 32)
    assert cost.t1 == pytest.approx(0.001) and cost(128) == pytest.approx(0.138)


def test_speculator_counts_a_verification_by_its_expected_yield():
    """The mode chooser sees a speculating request's step as E(k) tokens, not the 1..k+1 it
    happened to yield: the correction is E(k) - (accepted + 1) per verification."""
    import torch

    from backend.speculative.ngram_proposer import NgramProposer
    from backend.speculative.speculator import Speculator

    spec = Speculator(NgramProposer(), max_k=4, adaptive=True, device=torch.device("cpu"), draft_budget=64)
    r = Request("r", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], SamplingParams())  # repeats: the lookup proposes
    r.num_computed_tokens = r.num_tokens - 1
    step = spec.begin_step()
    spec.reserve([r], max_model_len=100)
    k = r.spec.num_lookahead_tokens
    assert k > 0  # room reserved; the drafts come once the step is scheduled
    expected = spec.control.expected_yields(["r"])[0][k]
    assert step.expected["r"][k] == expected > 1  # the plan's expectation travels with its step
    spec.record(step, r, k, 0)  # every draft token rejected: 1 token realized
    assert step.yield_correction == pytest.approx(expected - 1)
    assert (r.spec.num_draft_tokens, r.spec.num_accepted_tokens) == (k, 0)
    assert spec.begin_step().yield_correction == 0.0  # a new step starts from no correction


def test_linear_cost_takes_a_measured_size_as_measured():
    """A float32 matmul of 4 rows costs about twice one of 3 on a CPU: a size measured twice is
    its samples' mean, not the line through every size."""
    cost = LinearCost()
    for n, seconds in ((1, 0.071), (2, 0.075), (3, 0.078), (4, 0.117), (5, 0.124)) * 2:
        cost.add(n, seconds)
    assert cost(3) == pytest.approx(0.078) and cost(4) == pytest.approx(0.117)
    assert cost(8) == pytest.approx(cost.t0 + 8 * cost.t1)  # unmeasured: the line


# -- the decision on measured costs -------------------------------------------------------------
# Forward seconds by size measured on the default model (SmolLM2-135M, int4, compile_decode and
# compile_prefill, 2-core Xeon; docs/performance.md, "Dense copies from 16 rows": a compiled decode
# step of one request 8.63-8.79 ms, a compiled 8-token forward 27.4-32.0 ms) and its EAGLE head (a
# forward 1.15-1.18 ms; perf/results/default_models.md), two samples per size as the engine would
# have fed them: a verification of 2-5 tokens is priced on the line between, as the control prices
# a size it has not measured.
MEASURED_COSTS = Path(__file__).resolve().parents[1] / "fixtures" / "spec_costs.json"


def _measured_control(config: str, method: str) -> SpecControl:
    """A control fed the recorded forwards through the interface the engine feeds it by."""
    costs = json.loads(MEASURED_COSTS.read_text())[config][method]
    c = SpecControl(max_k=4, free_drafts=method == "ngram adaptive")
    for n, seconds in costs["target"].items():
        for s in seconds:
            c.observe_target_forward(int(n), s)
    for n, seconds in costs["draft_first"].items():
        for s in seconds:
            c.observe_draft_forward(0, int(n), 1, s)
    for n, seconds in costs["draft"].items():
        for s in seconds:
            c.observe_draft_forward(1, int(n), int(n), s)
    return c


def _decode(c: SpecControl, num: int, acceptance: float, steps: int, rng: np.random.Generator) -> tuple[str, float]:
    """`steps` decode-only steps of `num` requests, each draft token accepted with probability
    `acceptance` while the ones before it were; a step lasts what the control measured for its
    forwards (the target's at its tokens, the draft's). Returns each step's largest k, as digits,
    and the tokens per second against plain decoding's."""
    requests = [Request(str(i), [1, 2, 3], SamplingParams()) for i in range(num)]
    plain_seconds = c.target_cost(num)
    plan, seconds, tokens = "", 0.0, 0.0
    for _ in range(steps):
        ks, expected = c.plan(requests, num)
        # the head's first forward reads what each speculating request's last verification kept
        catch_up = sum(expected[i][k] for i, k in enumerate(ks) if k)
        step_seconds = c.target_cost(num + sum(ks)) + c.draft_seconds(num, max(ks), catch_up)
        step_tokens = expected_tokens = 0.0
        for r, k in zip(requests, ks):
            passed = rng.random(k) < acceptance  # [k]: draft token i would be accepted
            accepted = k if passed.all() else int(np.argmin(passed))  # up to the first rejection
            c.observe_verification(r.request_id, k, accepted)
            step_tokens += 1 + accepted
            expected_tokens += expected[int(r.request_id)][k] if expected is not None and k else 1
        # as the speculator counts a step: a probe's tokens as they came, others' as expected
        c.observe_step(any(ks), num, step_tokens if c.probing else expected_tokens, step_seconds)
        tokens += step_tokens
        seconds += step_seconds
        plan += str(max(ks))
    return plan, tokens / seconds / (num / plain_seconds)


def _best_predicted_speedup(c: SpecControl, num: int, acceptance: float) -> float:
    """max over k of S(k): `num` requests' expected tokens per second with k drafts each (every
    draft token accepted with probability `acceptance` while the ones before it were), over
    plain decoding's, on the control's measured costs."""
    best = 0.0
    for k in range(1, c.max_k + 1):
        tokens = num * sum(acceptance**i for i in range(k + 1))
        seconds = c.target_cost(num * (1 + k)) + c.draft_seconds(num, k, tokens)
        best = max(best, tokens / seconds / (num / c.target_cost(num)))
    return best


# about what the default model's EAGLE head accepts per drafted token on held-out chat at k = 3
# (prompt lookup's 0.30 is close); a proposer that agrees 90% of the time wins
WEAK_ACCEPTANCE, STRONG_ACCEPTANCE = 0.2, 0.9


@pytest.mark.parametrize("method", ["eagle adaptive", "ngram adaptive"])
def test_on_measured_compiled_steps_a_losing_method_stands_aside_and_returns_once_it_wins(method):
    num = 1
    c = _measured_control("int4 compiled", method)
    # the premise, from the recorded forwards: against compiled decode the method loses at the
    # head's acceptance, and wins at a high one
    assert _best_predicted_speedup(c, num, WEAK_ACCEPTANCE) < 0.9
    assert _best_predicted_speedup(c, num, STRONG_ACCEPTANCE) > 1.2
    rng = np.random.default_rng(0)
    weak, weak_ratio = _decode(c, num, WEAK_ACCEPTANCE, 1000, rng)
    assert weak_ratio >= 0.97  # never more than 3% below plain decoding, probes included
    assert weak[MAX_EXPLORE_EVERY:].count("0") >= 0.85 * len(weak[MAX_EXPLORE_EVERY:])  # off but for probes
    _decode(c, num, STRONG_ACCEPTANCE, 2 * MAX_EXPLORE_EVERY, rng)  # acceptance rises: a probe sees it
    strong, strong_ratio = _decode(c, num, STRONG_ACCEPTANCE, 300, rng)
    assert strong.count("0") <= 0.05 * len(strong) and strong_ratio > 1.1
