"""Adaptive speculation: k from measured survival and costs (the on/off choice: test_mode_chooser.py)."""
import numpy as np
import pytest

from backend.core.request import Request
from backend.sampling_params import SamplingParams
from backend.spec.spec_control import REQUEST_MEMORY, LinearCost, SpecControl, Survival


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

    from backend.spec.ngram_proposer import NgramProposer
    from backend.spec.speculator import Speculator

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
