"""Adaptive speculation: the S(k) model and the measured on/off choice."""
import pytest

from backend.request import Request
from backend.sampling_params import SamplingParams
from backend.spec_controller import SpecController, expected_tokens, speedup
from backend.speculator import EXPLORE_EVERY, ModeChooser


def test_formula_values():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert speedup(0.8, 3, 0.1) == pytest.approx((1 - 0.8**4) / (0.2 * 1.3))
    assert speedup(0.1, 1, 0.5) < 1  # a poor draft does not pay


def _requests(n, a):
    reqs = [Request(str(i), [1], SamplingParams()) for i in range(n)]
    for r in reqs:
        r.acceptance_rate = a
    return reqs


def _controller(target_t0, target_t1, draft_t0):
    c = SpecController(max_k=4)
    for n in (1, 64, 128):
        c.target_cost.add(n, target_t0 + target_t1 * n)
        c.draft_cost.add(n, draft_t0)
    return c


def test_good_draft_on_a_memory_bound_target_speculates():
    c = _controller(target_t0=0.010, target_t1=0.0, draft_t0=0.001)
    assert c.plan(_requests(1, 0.8)) == [4]


def test_compute_bound_target_at_large_batch_turns_speculation_off():
    # every extra token costs as much as a request's whole decode: verification cannot pay
    c = _controller(target_t0=0.0, target_t1=0.001, draft_t0=0.002)
    assert c.plan(_requests(64, 0.5)) == [0] * 64


def test_poor_acceptance_turns_speculation_off():
    c = _controller(target_t0=0.010, target_t1=0.0, draft_t0=0.004)
    assert c.plan(_requests(4, 0.05)) == [0] * 4


def test_mode_chooser_follows_measured_rates_and_explores():
    m = ModeChooser()
    assert m.speculate(8) is True  # nothing measured: try speculation first
    m.observe(True, 8, 100, 1.0)
    assert m.speculate(8) is False  # then without
    m.observe(False, 8, 150, 1.0)
    choices = [m.speculate(8) for _ in range(2 * EXPLORE_EVERY)]
    assert choices.count(True) == 2  # the slower mode only on exploration steps
    m.observe(True, 8, 1000, 1.0)  # speculation got much faster: it wins now
    m.observe(True, 8, 1000, 1.0)
    assert [m.speculate(8) for _ in range(EXPLORE_EVERY)].count(False) == 1
