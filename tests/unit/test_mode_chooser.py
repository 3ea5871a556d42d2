"""The measured on/off choice of speculation, per batch-size bucket (backend/spec/mode_chooser.py)."""
import pytest

from backend.spec.mode_chooser import EXPLORE_BUDGET, EXPLORE_EVERY, MAX_EXPLORE_EVERY, MEASURE_STEPS, ModeChooser


def _choices(m: ModeChooser, steps: int, observe=None) -> str:
    out = []
    for _ in range(steps):
        on = m.speculate(8)
        out.append("1" if on else "0")
        if observe:
            m.observe(on, 8, *observe(on))
    return "".join(out)


def test_mode_chooser_follows_measured_rates_and_explores_less_once_settled():
    m = ModeChooser()
    off_is_faster = lambda on: (100 if on else 150, 1.0)  # noqa: E731
    assert _choices(m, 2 * MEASURE_STEPS, off_is_faster) == "10" * MEASURE_STEPS  # alternate first
    choices = _choices(m, 9 * EXPLORE_EVERY, off_is_faster)
    bursts = [i for i in range(len(choices)) if choices.startswith("1" * MEASURE_STEPS, i) and (i == 0 or choices[i - 1] == "0")]
    assert choices.count("1") == 3 * MEASURE_STEPS  # the slower mode only in bursts ...
    assert [b - a for a, b in zip(bursts, bursts[1:])] == [MEASURE_STEPS + 2 * EXPLORE_EVERY,
                                                            MEASURE_STEPS + 4 * EXPLORE_EVERY]  # ... ever rarer
    assert choices.endswith("0" * EXPLORE_EVERY)


def test_mode_chooser_switches_when_the_other_mode_gets_faster():
    m = ModeChooser()
    _choices(m, 2 * MEASURE_STEPS + 200, lambda on: (100 if on else 150, 1.0))
    choices = _choices(m, 2 * MAX_EXPLORE_EVERY, lambda on: (1000 if on else 150, 1.0))  # speculation wins now
    assert choices.endswith("1" * EXPLORE_EVERY)
    assert choices.count("0") < MAX_EXPLORE_EVERY


def test_mode_chooser_rate_is_tokens_over_time_not_a_mean_of_rates():
    m = ModeChooser()
    m.observe(True, 1, 1, 0.9)  # a slow step that yielded 1 token
    m.observe(True, 1, 9, 0.1)  # a fast one that yielded 9
    assert m.rate(True, 1) == pytest.approx((0.9 * 1 + 9) / (0.9 * 0.9 + 0.1))


def test_mode_chooser_keeps_batch_size_buckets_apart():
    m = ModeChooser()
    for _ in range(MEASURE_STEPS):
        m.observe(True, 1, 200, 1.0)
        m.observe(False, 1, 100, 1.0)
        m.observe(True, 64, 100, 1.0)
        m.observe(False, 64, 200, 1.0)
    assert [m.speculate(1) for _ in range(EXPLORE_EVERY)].count(True) == EXPLORE_EVERY - 1
    assert [m.speculate(64) for _ in range(EXPLORE_EVERY)].count(False) == EXPLORE_EVERY - 1


def test_mode_chooser_borrows_a_measured_neighbour_bucket_and_alternates_while_blind():
    m = ModeChooser()
    assert [m.speculate(64) for _ in range(4)] == [True, False, True, False]  # mixed steps, nothing observed
    for _ in range(MEASURE_STEPS):
        m.observe(True, 64, 100, 1.0)
        m.observe(False, 64, 200, 1.0)
    # the batch shrank to 40 requests (the next bucket down): no new warm-up with speculation on
    assert [m.speculate(40) for _ in range(EXPLORE_EVERY - 1)].count(True) == 0


def test_mode_chooser_switches_speculation_on_only_when_it_earns_the_switch_back():
    """From plain decoding, speculation must beat it by enough to pay the drafts' catch-up before
    the next exploration burst; a gain too small for that stays off."""
    def settled(on_rate: float, switch_seconds: float) -> str:
        m = ModeChooser()
        _choices(m, 2 * MEASURE_STEPS, lambda on: (150, 1.0))  # warm-up: a tie
        for _ in range(40):  # speculation's rate is now about on_rate (older samples decayed)
            m.observe(True, 8, on_rate, 1.0)
        m.charge_switch(8, switch_seconds)
        return _choices(m, EXPLORE_EVERY // 2)

    # a plain step of 8 requests at 150 tok/s takes 53 ms: a 0.2 s switch over the 32 steps before
    # the next burst asks for a 12% gain
    assert settled(140, 0.0) == "0" * (EXPLORE_EVERY // 2)  # slower stays off
    assert settled(160, 0.2) == "0" * (EXPLORE_EVERY // 2)  # +6.5%: does not pay the switch
    assert settled(160, 0.0) == "1" * (EXPLORE_EVERY // 2)  # ... and does when switching is free
    assert settled(180, 0.2) == "1" * (EXPLORE_EVERY // 2)  # +20% pays it


def test_mode_chooser_keeps_costly_switch_on_bursts_to_a_budget():
    """Bursts that try speculation again from plain decoding make every draft catch up: when
    that is dear, they come no more often than EXPLORE_BUDGET of the time pays for."""
    off_is_faster = lambda on: (100 if on else 150, 1.0)  # noqa: E731
    cheap, dear = ModeChooser(), ModeChooser()
    for m in (cheap, dear):
        _choices(m, 2 * MEASURE_STEPS, off_is_faster)
    dear.charge_switch(8, 1.0)  # a plain step of 8 requests at 150 tok/s takes 53 ms
    gap = 1.0 * 150 / (EXPLORE_BUDGET * 8)  # steps between such bursts: 625
    assert _choices(cheap, 400, off_is_faster).count("1") == 4 * MEASURE_STEPS  # bursts at 32, 100, 232, 364
    choices = _choices(dear, 700, off_is_faster)
    assert choices.index("1") >= gap - 2 * MEASURE_STEPS - 1 and choices.count("1") == MEASURE_STEPS


def test_mode_chooser_burst_waits_for_a_catch_up_of_several_steps():
    """Drafts further behind than one step's budget catch up over several steps: the burst
    measures speculation after them, and they count as one switch's cost."""
    m = ModeChooser()
    off_is_faster = lambda on: (100 if on else 150, 1.0)  # noqa: E731
    _choices(m, 2 * MEASURE_STEPS, off_is_faster)
    choices, catch_ups = "", 3
    for _ in range(EXPLORE_EVERY + MEASURE_STEPS + catch_ups):
        on = m.speculate(8)
        choices += "1" if on else "0"
        if on and catch_ups:
            m.charge_switch(8, 0.1)
            catch_ups -= 1
        else:
            m.observe(on, 8, *off_is_faster(on))
    assert choices.count("1") == MEASURE_STEPS + 3 and "1" * (MEASURE_STEPS + 3) in choices
    assert choices.endswith("0")
    assert m.buckets[m.bucket(8)].switch_seconds == pytest.approx(0.3)


def test_mode_chooser_tells_a_steady_speculating_step_from_a_switch():
    """A draft catch-up in a steady speculating step (a new request reading its prompt) counts in
    speculation's rate; one in a step that switched speculation on is the switch's cost."""
    m = ModeChooser()
    on_is_faster = lambda on: (200 if on else 150, 1.0)  # noqa: E731
    _choices(m, 2 * MEASURE_STEPS, on_is_faster)  # warm-up alternation: never steady
    assert not m.steady(8)
    assert m.speculate(8) and not m.steady(8)  # the first choice after warm-up switches it on
    assert m.speculate(8) and m.steady(8)  # then it stays on
    m.buckets[m.bucket(8)].explore_at = m.buckets[m.bucket(8)].steps + 1
    assert not m.speculate(8) and not m.steady(8)  # an exploration burst without speculation
