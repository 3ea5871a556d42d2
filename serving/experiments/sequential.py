"""Always-valid comparisons of one metric between two arms whose unit is the user.

Assignment is sticky by user, so a user's requests are not independent draws: a user with a slow
network or long prompts is slow on every request. The unit of analysis is therefore the user, as in
the delta-method/cluster-robust analyses of Deng, Knoblich and Lu ("Applying the Delta Method in
Metric Analytics", KDD 2018, arXiv 1803.06336): per user and stratum, the mean of the user's values
(log latencies, or 0/1 indicators); per stratum, the mean of those user means; and the variance from
the users' own spread, with a user's values in different strata (periods of constant weights, arms
a user moved between) kept together as one unit.

A metric may instead be request-weighted (the tail shares): per stratum the share of the requests
themselves, R_s = sum_u t_us / sum_u n_us (t_us: the user's sum of values there, n_us: how many),
a ratio of sums whose cluster-robust (delta method) variance takes each user's residual
t_us - R_s n_us as the unit (Deng et al. again). Every request then counts, not every user once:
a rare event such as a request above the 99th percentile is seen in a share of requests, and
averaging users' shares of it first throws most of them away.

A stratum is (period, arm); a period is a stretch of constant weights. The difference between an
arm B and the control A is combined over periods (stratified, so that load drifting between rollout
steps does not masquerade as an effect of a weight change):

    theta = sum_k w_k (m_kB - m_kA),   w_k proportional to G_kA G_kB / (G_kA + G_kB)

where m_s is stratum s's mean of user means and G_s its users; a period enters once both arms have
`min_users` users there (the minimum sample before the first look). Its variance is the
cluster-robust one over users u,

    V = sum_u (sum_s a_s (v_us - m_s 1[u in s]))^2,   a_s = +-w_k / sqrt(G_s (G_s - 1))

(with G_s (G_s - 1) the usual small-sample correction), floored by the variance the same estimate
would have with independent users and the arms' pooled spread, so that an arm whose few users
happen to agree is not taken for a precise one. Expanded, V needs only three S x S sums over users
per metric, C = sum_u v_u v_u^T, X = sum_u v_u 1_u^T and P = sum_u 1_u 1_u^T, kept as running
statistics: a request changes one user's row, and each sum by an outer product. A request-weighted
metric keeps the same sums of t_u and n_u in place of v_u and 1_u, with a_s = +-w_k / N_s
sqrt(G_s / (G_s - 1)) (N_s: the stratum's values) and the floor of independent requests.

The test is the mixture sequential probability ratio test with a normal mixture N(0, tau^2) over
the true difference (Robbins 1970; Johari, Koomen, Pekelis and Walsh, "Always Valid Inference",
arXiv 1512.04922), read as an asymptotic confidence sequence with the plug-in variance above
(Waudby-Smith, Arbour, Sinha, Kennedy and Ramdas, "Time-uniform central limit theory and
asymptotic confidence sequences", arXiv 2103.06476; the boundary is Howard, Ramdas, McAuliffe and
Sekhon's normal mixture, arXiv 1810.08240). For one tau,

    log Lambda_tau(d, V) = 1/2 log(V / (V + tau^2)) + d^2 tau^2 / (2 V (V + tau^2))

is largest for effects near tau; an equal-weight average over a ladder of taus (each a doubling of
the last) is still a mixture, so still valid, and finds a 2x regression in a few dozen users as
well as a 5 % one in thousands, for log(len(taus)) more evidence than the best single tau. The
always-valid p-value is min over looks of 1 / Lambda(theta_t, V_t); the confidence sequence CS_t is
every d0 with Lambda(theta_t - d0, V_t) < 1 / alpha. The p-value falls below alpha exactly when CS_t
first leaves 0 out, and the chance that this ever happens between identical arms, however often one
looks, is at most alpha.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


NEWTON_STEPS = 6  # from above, on a convex rising function: each step lands closer, never past (3 reach 1e-12)


def _mixture_terms(v: np.ndarray, taus: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """log Lambda_tau(d, v) = a_tau + b_tau d^2: a, b as [len(taus), ...] arrays."""
    t2 = np.array(taus, dtype=float).reshape((-1,) + (1,) * np.ndim(v)) ** 2
    return 0.5 * np.log(v / (v + t2)), t2 / (2 * v * (v + t2))


def _log_sum_exp(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x))) over the first axis."""
    top = x.max(axis=0)
    return top + np.log(np.exp(x - top).sum(axis=0))


def log_mixture_ratio(d: np.ndarray, v: np.ndarray, taus: tuple[float, ...]) -> np.ndarray:
    """log Lambda, the average over taus, for differences d with variances v (elementwise; v > 0)."""
    a, b = _mixture_terms(np.asarray(v, dtype=float), taus)
    return _log_sum_exp(a + b * np.asarray(d, dtype=float) ** 2) - math.log(len(taus))


def radius(v: np.ndarray, taus: tuple[float, ...], alpha: float) -> np.ndarray:
    """The confidence sequence's half-width at variance v (elementwise; v > 0): the d where
    log Lambda(d, v) reaches log(1 / alpha). In x = d^2, log Lambda is a log-sum-exp of lines, convex
    and rising: Newton's method from the right, starting where one tau's term alone gets there."""
    a, b = _mixture_terms(np.asarray(v, dtype=float), taus)
    target = math.log(len(taus) / alpha)
    x = ((target - a) / b).min(axis=0)
    for _ in range(NEWTON_STEPS):
        exponent = a + b * x
        top = exponent.max(axis=0)
        weights = np.exp(exponent - top)
        total = weights.sum(axis=0)
        x = x - (top + np.log(total) - target) * total / (b * weights).sum(axis=0)
    return np.sqrt(np.maximum(x, 0.0))


@dataclass(slots=True)
class Moments:
    """Sums over users after each of a batch's requests: [..., i] holds them with requests 0..i in.
    For a request-weighted metric v_us is the user's sum t_us and 1[u in s] its count n_us."""
    C: np.ndarray  # [(M,) S, S, n] sum_u v_us v_ut (v_us: user u's mean in stratum s, 0 if absent)
    X: np.ndarray  # [(M,) S, S, n] sum_u v_us 1[u in t]
    P: np.ndarray  # [(M,) S, S, n] sum_u 1[u in s] 1[u in t]
    G: np.ndarray  # [(M,) S, n] users with a value in the stratum
    N: np.ndarray  # [(M,) S, n] values in the stratum
    T: np.ndarray  # [(M,) S, n] their sum

    def __getitem__(self, metric: int) -> Moments:
        return Moments(*(getattr(self, f)[metric] for f in ("C", "X", "P", "G", "N", "T")))


class UserMoments:
    """Running per-user means of M metrics in strata, and the sums over users that the variance
    needs. Memory: two numbers per metric, user and stratum."""

    def __init__(self, num_metrics: int) -> None:
        self.sums = np.zeros((num_metrics, 0, 0))  # [M, S, users] the user's sum of values in the stratum
        self.counts = np.zeros((num_metrics, 0, 0))  # [M, S, users] and how many values
        self.C = self.X = self.P = np.zeros((num_metrics, 0, 0))  # [M, S, S] each, as in Moments
        self.G = self.N = self.T = np.zeros((num_metrics, 0))  # [M, S] each, as in Moments

    @property
    def num_strata(self) -> int:
        return self.C.shape[1]

    def _grow(self, num_users: int, num_strata: int) -> None:
        M, strata, users = self.sums.shape[0], max(num_strata, self.num_strata), self.sums.shape[2]
        if num_users > users:
            users = max(num_users, 2 * users)  # amortised growth
        if (M, strata, users) == self.sums.shape:
            return
        for name, shape in (("sums", (M, strata, users)), ("counts", (M, strata, users)),
                            ("C", (M, strata, strata)), ("X", (M, strata, strata)), ("P", (M, strata, strata)),
                            ("G", (M, strata)), ("N", (M, strata)), ("T", (M, strata))):
            old, new = getattr(self, name), np.zeros(shape)
            new[tuple(slice(0, k) for k in old.shape)] = old
            setattr(self, name, new)

    def add(self, users: np.ndarray, strata: np.ndarray, values: np.ndarray, valid: np.ndarray,
            num_strata: int, weighted: np.ndarray | None = None) -> Moments:
        """Take requests in order and return the sums after each. users, strata: [n] ints;
        values, valid: [M, n] each metric's value and whether the request has one; weighted: [M]
        bools, the request-weighted metrics."""
        (M, n), S = values.shape, max(num_strata, self.num_strata)
        self._grow(int(users.max(initial=-1)) + 1, S)
        step_sum, step_count = np.zeros((M, S, n)), np.zeros((M, S, n))
        step_sum[:, strata, np.arange(n)], step_count[:, strata, np.arange(n)] = np.where(valid, values, 0), valid
        # each user's running sums within the batch: cumulative sums over the batch sorted by user
        # (stable, so in time order within a user), less the sum before the user's first request
        order = np.argsort(users, kind="stable")
        by_user = users[order]
        first = np.flatnonzero(np.r_[True, by_user[1:] != by_user[:-1]])
        run_start = np.repeat(first, np.diff(np.r_[first, n]))
        last = np.r_[first[1:], n] - 1
        after_sum, after_count = np.empty((M, S, n)), np.empty((M, S, n))
        for out, step, state in ((after_sum, step_sum, self.sums), (after_count, step_count, self.counts)):
            running = np.cumsum(step[:, :, order], axis=2)
            padded = np.concatenate([np.zeros((M, S, 1)), running], axis=2)
            mine = state[:, :, by_user] + running - padded[:, :, run_start]
            out[:, :, order] = mine
            state[:, :, by_user[last]] = mine[:, :, last]
        before_sum, before_count = after_sum - step_sum, after_count - step_count
        v_after = np.divide(after_sum, after_count, out=np.zeros((M, S, n)), where=after_count > 0)
        v_before = np.divide(before_sum, before_count, out=np.zeros((M, S, n)), where=before_count > 0)
        p_after, p_before = (after_count > 0).astype(float), (before_count > 0).astype(float)
        linear = [state[..., None] + np.cumsum(step, axis=2) for state, step in (
            (self.G, p_after - p_before), (self.N, step_count), (self.T, step_sum))]
        if weighted is not None and weighted.any():  # sums and counts in place of means and presence
            v_after[weighted], v_before[weighted] = after_sum[weighted], before_sum[weighted]
            p_after[weighted], p_before[weighted] = after_count[weighted], before_count[weighted]
        moments = Moments(*(state[..., None] + np.cumsum(_outer(a, b) - _outer(c, d), axis=3)
                            for state, a, b, c, d in (
            (self.C, v_after, v_after, v_before, v_before), (self.X, v_after, p_after, v_before, p_before),
            (self.P, p_after, p_after, p_before, p_before))), *linear)
        if n:
            for name in ("C", "X", "P", "G", "N", "T"):
                setattr(self, name, getattr(moments, name)[..., -1].copy())
        return moments


def _outer(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a[:, :, None, :] * b[:, None, :, :]


def compare(moments: Moments, control: np.ndarray, arm: np.ndarray, min_users: int,
            binary: bool = False, weighted: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The stratified difference arm - control and its variance after each request, for one
    metric (moments[m]).

    control, arm: [K] the stratum of each period for either arm (-1: none yet). Returns theta [n]
    and V [n]; V is nan where no period has min_users users in both arms. binary: the values are
    0/1, and each period's pooled spread is at least p(1 - p) with p smoothed by one success and
    one failure (no spread at all is not taken for certainty). weighted: a request-weighted
    metric (binary only): each stratum's share of requests."""
    if weighted and not binary:
        raise ValueError("a request-weighted metric is a share: its values are 0 or 1")
    S, n = moments.P.shape[0], moments.P.shape[2]
    diagonal = np.arange(S)
    G = moments.G  # [S, n] users per stratum
    units = moments.N if weighted else G  # [S, n] what a stratum's mean is over: requests or users
    sums = moments.T if weighted else moments.X[diagonal, diagonal]  # [S, n] their sum
    squares = moments.T if weighted else moments.C[diagonal, diagonal]  # [S, n] sum of squares (0/1 if weighted)
    present = (control >= 0) & (arm >= 0)
    ca, cb = control[present], arm[present]
    ga, gb = G[ca], G[cb]  # [K, n]
    na, nb = units[ca], units[cb]
    ready = (ga >= max(min_users, 2)) & (gb >= max(min_users, 2))
    w = np.where(ready, na * nb / np.maximum(na + nb, 1), 0.0)
    total = w.sum(axis=0)
    w = np.divide(w, total, out=np.zeros_like(w), where=total > 0)
    m = np.divide(sums, units, out=np.zeros((S, n)), where=units > 0)
    c = np.zeros((S, n))  # each stratum's coefficient in theta
    c[ca], c[cb] = -w, w
    theta = (c * m).sum(axis=0)
    scale = units * np.sqrt(np.maximum(G - 1, 0) / np.maximum(G, 1)) if weighted else np.sqrt(G * (G - 1))
    a = np.divide(c, scale, out=np.zeros((S, n)), where=G > 1)
    am = a * m
    # sum_st a_s a_t (C_st - m_t X_st - m_s X_ts + m_s m_t P_st)
    v_cluster = (np.einsum("si,sti,ti->i", a, moments.C, a) - 2 * np.einsum("si,sti,ti->i", a, moments.X, am)
                 + np.einsum("si,sti,ti->i", am, moments.P, am))
    # the floor: independent units (users, or requests) with each period's pooled spread
    pooled_g = na + nb
    pooled_mean = np.divide(sums[ca] + sums[cb], pooled_g, out=np.zeros_like(na), where=pooled_g > 0)
    spread = np.divide(squares[ca] + squares[cb] - pooled_g * pooled_mean**2, pooled_g - 1,
                       out=np.zeros_like(na), where=pooled_g > 1)
    if binary:
        p = (pooled_mean * pooled_g + 1) / (pooled_g + 2)
        spread = np.maximum(spread, p * (1 - p))
    v_floor = (w**2 * spread * (np.divide(1, na, out=np.zeros_like(na), where=ready)
                                + np.divide(1, nb, out=np.zeros_like(nb), where=ready))).sum(axis=0)
    v = np.maximum(v_cluster, v_floor)
    v[(total == 0) | ~(v > 0)] = np.nan
    return theta, v
