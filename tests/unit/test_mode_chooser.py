"""The measured on/off choice of speculation, per batch-size bucket (backend/speculative/mode_chooser.py)."""
import pytest

from backend.speculative.mode_chooser import EXPLORE_EVERY, EXPLORE_LOSS, MAX_EXPLORE_EVERY, MEASURE_STEPS, ModeChooser


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
    off_is_faster = lambda on: (148 if on else 150, 1.0)  # noqa: E731 (a near tie: bursts cost little)
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
    # (and each mode is twice the other: a burst of the slower one waits past these steps)
    assert all(m.speculate(1) for _ in range(EXPLORE_EVERY))
    assert not any(m.speculate(64) for _ in range(EXPLORE_EVERY))


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


def test_mode_chooser_keeps_what_bursts_lose_to_a_share_of_the_time():
    """Trying the slower mode again loses time: its slower steps (a speculative step may cost
    more than two plain ones) and, for speculation, the drafts' catch-up. Bursts come no more
    often than EXPLORE_LOSS of the time pays for, however few steps apart that is."""
    def off_is_faster(on_rate):
        return lambda on: (on_rate if on else 150, 1.0)  # tokens in a step of 1 s

    def lost(choices: str, on_rate: float, switch_seconds: float = 0.0) -> float:
        """Seconds the bursts lost: each speculating step yields on_rate tokens where plain
        decoding yields 150, and each burst first pays the switch."""
        return choices.count("1") * (1 - on_rate / 150) + choices.count("1") // MEASURE_STEPS * switch_seconds

    close, far, dear = ModeChooser(), ModeChooser(), ModeChooser()
    for m, on_rate in ((close, 148), (far, 50), (dear, 148)):
        _choices(m, 2 * MEASURE_STEPS, off_is_faster(on_rate))
    dear.charge_switch(8, 1.0)  # the drafts' catch-up when speculation is tried: a plain step's time
    near_tie, much_slower, costly = (_choices(close, 1000, off_is_faster(148)), _choices(far, 1000, off_is_faster(50)),
                                     _choices(dear, 1000, off_is_faster(148)))
    assert near_tie.count("1") >= 6 * MEASURE_STEPS  # a near tie is tried as often as the step count allows
    assert lost(near_tie, 148) <= EXPLORE_LOSS * 1000
    assert MEASURE_STEPS <= much_slower.count("1") and lost(much_slower, 50) <= EXPLORE_LOSS * 1000
    assert near_tie.index("1") < much_slower.index("1")  # a dear burst waits
    assert MEASURE_STEPS <= costly.count("1") and lost(costly, 148, switch_seconds=1.0) <= EXPLORE_LOSS * 1000


def test_mode_chooser_burst_waits_for_a_catch_up_of_several_steps():
    """Drafts further behind than one step's budget catch up over several steps: the burst
    measures speculation after them, and they count as one switch's cost."""
    m = ModeChooser()
    off_is_faster = lambda on: (148 if on else 150, 1.0)  # noqa: E731 (a near tie: bursts cost little)
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
    on_is_faster = lambda on: (152 if on else 150, 1.0)  # noqa: E731 (a near tie: bursts cost little)
    _choices(m, 2 * MEASURE_STEPS, on_is_faster)  # warm-up alternation: never steady
    assert not m.steady(8)
    assert m.speculate(8) and not m.steady(8)  # the first choice after warm-up switches it on
    assert m.speculate(8) and m.steady(8)  # then it stays on
    m.buckets[m.bucket(8)].explore_at = m.buckets[m.bucket(8)].steps + 1
    assert not m.speculate(8) and not m.steady(8)  # an exploration burst without speculation
