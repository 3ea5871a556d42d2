"""The verdict's statistics (serving/experiments/sequential.py, serving/experiments/verdict.py): exact running sums,
the cluster-robust variance, the mixture boundary, invariance to how requests are batched, and the
decision rule. Error rates under continuous looks: tests/unit/test_ab_simulation.py."""
from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from perf.ab_simulation import ARMS, Scenario, simulate
from serving.experiments.request_log import RequestColumns
from serving.experiments.sequential import Moments, UserMoments, compare, log_mixture_ratio, radius
from serving.experiments.metrics import TAIL_BURN_IN, VerdictConfig, VerdictError
from serving.experiments.verdict import Verdict

TAUS = (0.025, 0.05, 0.1, 0.2, 0.4)


def _brute_force(users, strata, values, upto, num_users, num_strata):
    """Per-user means in strata after requests 0..upto: v [U, S] (0 if absent) and presence p."""
    sums, counts = np.zeros((num_users, num_strata)), np.zeros((num_users, num_strata))
    np.add.at(sums, (users[:upto + 1], strata[:upto + 1]), values[:upto + 1])
    np.add.at(counts, (users[:upto + 1], strata[:upto + 1]), 1)
    v = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
    return v, (counts > 0).astype(float)


def test_running_sums_equal_the_sums_over_users_after_every_request_however_batched():
    rng = np.random.default_rng(0)
    n, U, S = 300, 25, 4
    users, strata, values = rng.integers(0, U, n), rng.integers(0, S, n), rng.normal(size=n)
    moments = UserMoments(1)
    parts = [moments.add(users[a:b], strata[a:b], values[None, a:b], np.ones((1, b - a), bool), S)
             for a, b in ((0, 1), (1, 100), (100, 101), (101, n))]
    C, X, P = (np.concatenate([getattr(p, name)[0] for p in parts], axis=2) for name in ("C", "X", "P"))
    for i in range(n):
        v, p = _brute_force(users, strata, values, i, U, S)
        assert np.allclose(C[..., i], v.T @ v) and np.allclose(X[..., i], v.T @ p) and np.array_equal(P[..., i], p.T @ p)


def test_the_variance_is_the_cluster_robust_one_over_users_spanning_strata():
    """Users in several periods and in both arms (weights changed): V is the sum over users of their
    whole influence squared (or the pooled floor, whichever is larger), as written out by hand."""
    rng = np.random.default_rng(1)
    n, U = 600, 60
    users, strata = rng.integers(0, U, n), rng.integers(0, 4, n)  # strata: (period 0, 1) x (control, arm)
    values = rng.normal(size=n) + 0.5 * (users % 7)  # users have levels
    moments = UserMoments(1)
    m = moments.add(users, strata, values[None], np.ones((1, n), bool), 4)
    theta, v = compare(m[0], np.array([0, 2]), np.array([1, 3]), min_users=3)
    value, present = _brute_force(users, strata, values, n - 1, U, 4)
    G = present.sum(0)
    mean = value.sum(0) / G
    w = np.array([G[0] * G[1] / (G[0] + G[1]), G[2] * G[3] / (G[2] + G[3])])
    w /= w.sum()
    c = np.array([-w[0], w[0], -w[1], w[1]])
    influence = ((value - mean * present) * c / np.sqrt(G * (G - 1))).sum(1)
    floor = sum(w[k] ** 2 * np.concatenate([value[present[:, a] > 0, a], value[present[:, b] > 0, b]]).var(ddof=1)
                * (1 / G[a] + 1 / G[b]) for k, (a, b) in enumerate(((0, 1), (2, 3))))
    assert theta[-1] == pytest.approx((c * mean).sum())
    assert v[-1] == pytest.approx(max((influence**2).sum(), floor))


def test_a_period_enters_only_with_min_users_in_both_arms():
    moments = UserMoments(1)
    users = np.arange(40)
    strata = np.r_[np.zeros(20, int), np.ones(20, int)]  # 20 users in the control, then 20 in the arm
    m = moments.add(users, strata, np.ones((1, 40)), np.ones((1, 40), bool), 2)
    _, v = compare(m[0], np.array([0]), np.array([1]), min_users=20, binary=True)
    assert np.isnan(v[:39]).all() and np.isfinite(v[39])


def test_the_confidence_sequence_and_the_p_value_agree():
    """CS_t leaves 0 out exactly when Lambda(theta_t) reaches 1 / alpha; the radius solves it."""
    v = np.geomspace(1e-8, 1.0, 60)
    for alpha in (0.05, 0.05 / 12):
        r = radius(v, TAUS, alpha)
        assert np.allclose(log_mixture_ratio(r, v, TAUS), math.log(1 / alpha), atol=1e-9)
        assert (log_mixture_ratio(0.999 * r, v, TAUS) < math.log(1 / alpha)).all()
    # the mixture over taus is within log(len) of its best single tau, and never above it
    single = np.max([log_mixture_ratio(0.3, v, (t,)) for t in TAUS], axis=0)
    both = log_mixture_ratio(0.3, v, TAUS)
    assert (both <= single + 1e-12).all() and (both >= single - math.log(len(TAUS)) - 1e-12).all()


def _verdict(columns: RequestColumns, chunks: int | tuple[int, ...], config: VerdictConfig | None = None) -> Verdict:
    """The verdict fed `chunks` requests at a time (a tuple: those sizes in turn)."""
    verdict = Verdict(list(ARMS), config)
    sizes, start = itertools.cycle(chunks if isinstance(chunks, tuple) else (chunks,)), 0
    while start < len(columns):
        size = next(sizes)
        verdict.add(columns[start:start + size])
        start += size
    return verdict


def test_the_verdict_does_not_depend_on_how_requests_are_batched():
    """Requests a few at a time, one at a time now and then (the gateway), 97 at a time, or the
    whole log (a replay): the same decisions at the same request indices, the same estimates, the
    same tail thresholds."""
    scenario = Scenario("slower", ((1600, (70, 30)), (1400, (50, 50))), users=150, error_rate=0.02,
                        cancel_rate=0.02, bad_users=1, slower=1.2)
    columns = simulate(scenario, 3)
    reports = [json.dumps(_verdict(columns, chunks).report(), sort_keys=True, default=str)
               for chunks in ((1, 2, 1, 40, 7, 1, 200), 97, 4096)]
    whole = json.loads(reports[2])
    assert whole["arms"]["treatment"]["decision"] == "worse" and len(whole["tail_thresholds"]) == 4
    for report in reports[:2]:
        one = json.loads(report)
        assert one["tail_thresholds"] == whole["tail_thresholds"]
        for name, metric in whole["arms"]["treatment"]["metrics"].items():
            other = one["arms"]["treatment"]["metrics"][name]
            assert (other["decided_at"], other["direction"], other.get("non_inferior_at")) == \
                (metric["decided_at"], metric["direction"], metric.get("non_inferior_at")), name
            assert other["estimate"] == pytest.approx(metric["estimate"], rel=1e-9, abs=1e-12)
            assert other["p_value"] == pytest.approx(metric["p_value"], rel=1e-6, abs=1e-12)


def test_user_names_and_request_order_within_a_look_do_not_matter():
    columns = simulate(Scenario("a", ((2500, (50, 50)),), users=300, slower=1.15), 4)
    renamed = columns[:]
    renamed.user = np.array([f"someone-{u * 7919 % 100003}" for u in columns.user], dtype=object)
    first, second = _verdict(columns, 500).report(), _verdict(renamed, 500).report()
    assert first["arms"] == second["arms"] and first["users"] == second["users"]


def test_client_errors_count_for_no_arm_and_server_errors_do():
    """Users who send malformed requests (4xx) on one arm only: not the arm's errors. The same share
    of server errors: the arm is worse on errors."""
    columns = simulate(Scenario("a", ((3000, (50, 50)),), users=300), 5)
    treated = columns.arm == ARMS[1]
    bad_users = np.isin(columns.user, np.unique(columns.user[treated])[:30])
    for status, expected in (("client_error", None), ("error", "worse")):
        changed = columns[:]
        changed.status = np.where(treated & bad_users, status, columns.status)
        for name in ("ttft_s", "itl_s", "e2e_s"):
            setattr(changed, name, np.where(treated & bad_users, np.nan, getattr(columns, name)))
        verdict = _verdict(changed, 4096)
        assert verdict.states[(ARMS[1], "errors")].direction == expected, status
        assert verdict.report()["statuses"][ARMS[1]][status] == int((treated & bad_users).sum())


def test_a_better_median_with_a_worse_tail_is_worse():
    """9 % faster typical requests, but one in 20 is 15x slow instead of 5x: the tail test calls
    it worse, whatever the geometric means say."""
    scenario = Scenario("tail", ((12000, (50, 50)),), users=2000, zipf=0.8, slower=0.91, tail_share=0.05,
                        treatment_tail_factor=15)
    verdict = _verdict(simulate(scenario, 6), 4096)
    assert verdict.decision(ARMS[1])[0] == "worse"
    assert "worse" in {verdict.states[(ARMS[1], m)].direction for m in ("ttft_tail", "itl_tail")}


def test_better_needs_a_winning_success_metric_and_every_guardrail_non_inferior():
    scenario = Scenario("faster", ((8000, (50, 50)),), users=2000, zipf=0.8, slower=0.75)
    columns = simulate(scenario, 7)
    verdict = _verdict(columns, 4096)
    decision, at = verdict.decision(ARMS[1])
    states = {m: verdict.states[(ARMS[1], m)] for m in verdict.config.tested}
    assert decision == "better"
    assert at == max(min(states[m].decided_at for m in ("ttft", "itl", "e2e")),
                     *(states[m].non_inferior_at for m in ("errors", "ttft_tail", "itl_tail")))
    # the same data cut short of the guardrails' non-inferiority: no difference yet
    early = _verdict(columns[:at], 4096)
    assert early.decision(ARMS[1])[0] == "no difference"
    assert any(early.states[(ARMS[1], m)].direction == "better" for m in ("ttft", "itl", "e2e"))


def test_no_decision_before_the_first_look():
    columns = simulate(Scenario("a", ((400, (50, 50)),), users=None, slower=3.0), 8)
    verdict = _verdict(columns, 3, VerdictConfig(min_users=150))
    decided = verdict.states[(ARMS[1], "ttft")].decided_at
    assert decided is not None
    arm_users = np.cumsum(columns.arm[:decided + 1] == ARMS[1])[-1]
    control_users = decided + 1 - arm_users
    assert min(arm_users, control_users) >= 150


def test_tail_thresholds_freeze_on_the_pooled_burn_in():
    columns = simulate(Scenario("a", ((TAIL_BURN_IN + 500, (90, 10)),), users=None), 9)
    verdict = _verdict(columns, 333)
    answered = np.isfinite(columns.ttft_s)
    burn_in = columns.ttft_s[answered][:TAIL_BURN_IN]
    assert verdict.thresholds[("ttft_tail", 0)] == pytest.approx(np.quantile(burn_in, 0.99))


@pytest.mark.parametrize("values,message", [
    ({"alpha": 0.7}, "alpha"), ({"success": ["latency"]}, "latency"), ({"success": []}, "success"),
    ({"success": ["ttft"], "guardrails": {"ttft": 1.1}}, "success"), ({"success": ["itl"], "guardrails": {"ttft": 0.9}}, "margin"),
    ({"guardrails": {"errors": 0}}, "margin"), ({"min_users": 1}, "min_users"), ({"speed": 1}, "metrics"),
])
def test_a_bad_metrics_configuration_is_refused(values, message):
    with pytest.raises(VerdictError, match=message):
        VerdictConfig.from_dict(values)


def test_an_arm_not_in_the_experiment_is_refused():
    verdict = Verdict(list(ARMS))
    columns = simulate(Scenario("a", ((10, (50, 50)),), users=None), 0)
    columns.arm[3] = "stranger"
    with pytest.raises(VerdictError, match="stranger"):
        verdict.add(columns)


def test_percentiles_come_from_the_histograms_within_a_bin():
    verdict = Verdict(list(ARMS))
    columns = simulate(Scenario("a", ((5000, (50, 50)),), users=None), 10)
    verdict.add(columns)
    for arm in ARMS:
        x = columns.ttft_s[(columns.arm == arm) & np.isfinite(columns.ttft_s)]
        for q in (0.5, 0.9, 0.99):
            assert verdict.quantile(arm, "ttft_s", q) == pytest.approx(np.quantile(x, q), rel=0.13)  # a bin is 12 %


def test_moments_slice_one_metric():
    m = Moments(np.zeros((2, 3, 3, 4)), np.ones((2, 3, 3, 4)), np.full((2, 3, 3, 4), 2.0),
                *(np.full((2, 3, 4), k) for k in (3.0, 4.0, 5.0)))
    assert m[1].C.shape == (3, 3, 4) and float(m[1].P[0, 0, 0]) == 2.0 and m[1].T.shape == (3, 4)


def test_a_request_weighted_metric_keeps_sums_and_counts_and_its_variance_is_the_delta_methods():
    """Metric 1 request-weighted, metric 0 not, in one pass: after every request the sums over users
    of their sums t and counts n (in place of means and presence), the users, values and totals per
    stratum; and V is the delta method's over users, sum_u (sum_s c_s (t_us - R_s n_us) / N_s)^2
    with the small-sample factor G / (G - 1), or the floor of independent requests."""
    rng = np.random.default_rng(2)
    n, U, S = 800, 50, 4
    users, strata = rng.integers(0, U, n), rng.integers(0, S, n)
    values = np.stack([rng.normal(size=n), rng.random(n) < 0.05 + 0.1 * (users % 3 == 0)]).astype(float)
    moments = UserMoments(2)
    m = moments.add(users, strata, values, np.ones((2, n), bool), S, np.array([False, True]))
    for i in (0, 17, 400, n - 1):
        t, counts = (np.zeros((U, S)) for _ in range(2))
        np.add.at(t, (users[:i + 1], strata[:i + 1]), values[1, :i + 1])
        np.add.at(counts, (users[:i + 1], strata[:i + 1]), 1)
        assert np.allclose(m.C[1, ..., i], t.T @ t) and np.allclose(m.X[1, ..., i], t.T @ counts)
        assert np.array_equal(m.P[1, ..., i], counts.T @ counts)
        assert np.array_equal(m.G[:, :, i], np.stack([(counts > 0).sum(0)] * 2))
        assert np.array_equal(m.N[:, :, i], np.stack([counts.sum(0)] * 2)) and np.allclose(m.T[1, :, i], t.sum(0))
        v, _ = _brute_force(users, strata, values[0], i, U, S)
        assert np.allclose(m.C[0, ..., i], v.T @ v)  # the other metric as before
    theta, variance = compare(m[1], np.array([0, 2]), np.array([1, 3]), min_users=3, binary=True, weighted=True)
    G, N, T = (counts > 0).sum(0), counts.sum(0), t.sum(0)
    R = T / N
    w = np.array([N[0] * N[1] / (N[0] + N[1]), N[2] * N[3] / (N[2] + N[3])])
    w /= w.sum()
    c = np.array([-w[0], w[0], -w[1], w[1]])
    influence = ((t - R * counts) * c / N * np.sqrt(G / (G - 1))).sum(1)
    floor = 0.0
    for k, (a, b) in enumerate(((0, 1), (2, 3))):
        p = (T[a] + T[b] + 1) / (N[a] + N[b] + 2)
        share = (T[a] + T[b]) / (N[a] + N[b])
        spread = max((T[a] + T[b]) * (1 - share) ** 2 + (N[a] + N[b] - T[a] - T[b]) * share**2, 0) / (N[a] + N[b] - 1)
        floor += w[k] ** 2 * max(spread, p * (1 - p)) * (1 / N[a] + 1 / N[b])
    assert theta[-1] == pytest.approx((c * R).sum())
    assert variance[-1] == pytest.approx(max((influence**2).sum(), floor))
    with pytest.raises(ValueError, match="share"):
        compare(m[0], np.array([0]), np.array([1]), min_users=3, weighted=True)


def test_a_report_costs_the_same_whatever_the_requests_and_users():
    """A read of the verdict (every GET of /v1/experiment) is O(arms x metrics x strata^2): it
    allocates no more after 20,000 requests from 10,000 users than after 2,000 from 200, and
    counts each metric's values from a running total, equal to the per-user counts' sum."""
    import tracemalloc

    peaks = []
    for requests, users in ((2000, 200), (20_000, 10_000)):
        verdict = _verdict(simulate(Scenario("big", ((requests, (50, 50)),), users=users), 5), 4096)
        verdict.report()  # first use of every code path
        tracemalloc.start()
        report = verdict.report()
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        for i, name in enumerate(verdict.config.tested):
            assert report["arms"]["treatment"]["metrics"][name]["values"] == verdict.moments.counts[i].sum()
    assert peaks[1] < 200_000 and peaks[1] < 1.5 * peaks[0], peaks
