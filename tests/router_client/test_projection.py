import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router_client.fscore import candidate_rows
from router_client.projection import (
    aged_law,
    end_cdf,
    end_quantile,
    end_rate,
    mixture_loads,
    mixture_moments,
    projected_loads,
)


def direct_projection(workers, horizon, worker, size, c_hat):
    out = np.zeros((workers, horizon + 1))
    for g, s, c in zip(worker, size, np.clip(c_hat, 1, max(horizon, 1)), strict=True):
        for h in range(horizon + 1):
            alive = 1.0 if c >= horizon else min(1.0, max(0.0, c - h))  # c = H: at least H
            out[g, h] += (s + h) * alive
    return out


@given(seed=st.integers(0, 2**32 - 1), workers=st.integers(1, 6), horizon=st.integers(0, 25),
       n=st.integers(0, 30))
def test_projection_equals_direct_loop(seed, workers, horizon, n):
    rng = np.random.default_rng(seed)
    worker = rng.integers(0, workers, n)
    size = rng.integers(1, 1000, n).astype(float)
    c_hat = rng.uniform(0, horizon, n)
    np.testing.assert_allclose(
        projected_loads(workers, horizon, worker, size, c_hat),
        direct_projection(workers, horizon, worker, size, c_hat),
        atol=1e-9,
    )


def test_h0_column_is_the_current_load_and_requests_grow():
    # one request of size 100 that lives 3 more steps: 100, 101, 102, then gone
    got = projected_loads(2, 5, np.array([1]), np.array([100.0]), np.array([3.0]))
    np.testing.assert_allclose(got[1], [100, 101, 102, 0, 0, 0])
    np.testing.assert_allclose(got[0], 0)
    # a fractional life: half weight on the step after the whole ones
    got = projected_loads(1, 3, np.array([0]), np.array([10.0]), np.array([1.5]))
    np.testing.assert_allclose(got[0], [10, 5.5, 0, 0])


def test_mixture_with_certain_outcomes_is_the_step_projection():
    rng = np.random.default_rng(3)
    workers, horizon, n = 3, 20, 30
    worker = rng.integers(0, workers, n)
    size = rng.integers(10, 500, n).astype(float)
    remaining = rng.integers(1, 40, n)
    c_hat = np.minimum(remaining, horizon).astype(float)
    p_fin = (remaining < horizon).astype(float)
    mixture = mixture_loads(workers, horizon, worker, size, p_fin, remaining.astype(float),
                            end_points=0)
    step = projected_loads(workers, horizon, worker, size, c_hat)
    np.testing.assert_allclose(mixture, step)


def test_mixture_is_the_expected_load_of_the_two_point_law():
    # one request of size 100: ends after 5 steps with probability 0.5, else runs through H
    got = mixture_loads(1, 10, np.array([0]), np.array([100.0]), np.array([0.5]),
                        np.array([5.0]), end_points=0)[0]
    want = [(100 + h) * (1.0 if h < 5 else 0.5) for h in range(11)]
    np.testing.assert_allclose(got, want)


def test_spread_end_time_hand_worked():
    # Size 100, p_fin 0.5, mu_rem 5, H 10: the ending half ends uniformly on [0, 10], at the
    # quantile midpoints 1.25, 3.75, 6.25, 8.75 (weight 1/8 each). Alive weight at step h:
    # 1/2 + 1/8 * (alive at h of each), a point at t alive fully before floor(t), t - floor(t)
    # at floor(t). h = 1: 0.25 + 1 + 1 + 1 -> 0.5 + 3.25 / 8 = 0.90625, and so on.
    alive = [1.0, 0.90625, 0.875, 0.84375, 0.75, 0.75, 0.65625, 0.625, 0.59375, 0.5, 0.5]
    got = mixture_loads(1, 10, np.array([0]), np.array([100.0]), np.array([0.5]),
                        np.array([5.0]), end_points=4)[0]
    np.testing.assert_allclose(got, [(100 + h) * a for h, a in enumerate(alive)])
    # mu_rem 8 > H/2: uniform on [6, 10], points 6.5, 7.5, 8.5, 9.5: all alive up to h = 5
    # (with the uniform law, the option kept; mu_rem = H/2 above is the same under both)
    late = mixture_loads(1, 10, np.array([0]), np.array([100.0]), np.array([1.0]),
                         np.array([8.0]), end_points=4, end_shape="uniform")[0]
    alive = [1, 1, 1, 1, 1, 1, 0.875, 0.625, 0.375, 0.125, 0.0]
    np.testing.assert_allclose(late, [(100 + h) * a for h, a in enumerate(alive)])
    # a point at t is alive for t steps in all (floor(t) whole, the fraction at floor(t)):
    # the expected alive steps are the law's mean, mu_rem
    assert sum(alive) == pytest.approx(8.0)


def test_exponential_end_time_hand_worked():
    # The default law with rate x = ln 16 over H = 10 (e^-x = 1/16): mean 10 (1/x - 1/15) =
    # 2.94007 steps; quantile of u: 10 ln(1 / (1 - 15 u / 16)) / ln 16, at u = 1/8, 3/8, 5/8,
    # 7/8: 0.4496 (clipped to 1), 1.5624, 3.1802, 6.1911. Alive share at h (p_fin 1, each
    # point 1/4): h = 1: (0 + 0.5624 + 1 + 1) / 4, h = 3: (0.1802 + 1) / 4, h = 6: 0.1911 / 4.
    mu = 10 * (1 / np.log(16) - 1 / 15)
    got = mixture_loads(1, 10, np.array([0]), np.array([100.0]), np.array([1.0]),
                        np.array([mu]), end_points=4)[0]
    alive = [1.0, 2.5624014 / 4, 0.5, 1.1801989 / 4, 0.25, 0.25, 0.1910951 / 4, 0, 0, 0, 0]
    np.testing.assert_allclose(got, [(100 + h) * a for h, a in enumerate(alive)], rtol=1e-6,
                               atol=1e-9)


def test_refill_takes_an_emptied_slot_hand_worked() -> None:
    # One request of 10 tokens ending after 2 steps (H = 4); refills of 5 tokens grow from
    # the step it ended: 10, 11, then 5, 6, 7. Without refill the slot stays empty.
    worker, size = np.array([0]), np.array([10])
    plain = projected_loads(1, 4, worker, size, np.array([2.0]))
    np.testing.assert_allclose(plain, [[10, 11, 0, 0, 0]])
    refilled = projected_loads(1, 4, worker, size, np.array([2.0]), refill=5.0)
    np.testing.assert_allclose(refilled, [[10, 11, 5, 6, 7]])
    # Half alive at step 2 (c_hat 2.5): 0.5 * 12 of it plus 0.5 * 5 of the refill.
    half = projected_loads(1, 4, worker, size, np.array([2.5]), refill=5.0)
    np.testing.assert_allclose(half, [[10, 11, 8.5, 6, 7]])
    # "At least H" never empties its slot: no refill.
    capped = projected_loads(1, 4, worker, size, np.array([4.0]), refill=5.0)
    np.testing.assert_allclose(capped, projected_loads(1, 4, worker, size, np.array([4.0])))


def test_refill_of_a_candidate_row_matches_the_projection() -> None:
    rows = candidate_rows(np.array([3.0, 3.0]), np.array([2.0, 2.5]), 4, refill=5.0)
    np.testing.assert_allclose(rows, [[3, 4, 5, 6, 7], [3, 4, 5, 6, 7]])
    for c in (1.0, 2.0, 2.5, 3.7):
        row = candidate_rows(np.array([3.0]), np.array([c]), 4, refill=5.0)[0]
        projected = projected_loads(1, 4, np.array([0]), np.array([3]), np.array([c]),
                                    refill=5.0)[0]
        np.testing.assert_allclose(row, projected)


def test_spread_hand_worked_and_known_loads_have_none():
    # The request of test_spread_end_time_hand_worked: alive weight q_h, variance
    # (100 + h)^2 q (1 - q); h = 0 is known (q = 1), a capped request (p_fin 0) too.
    alive = np.array([1.0, 0.90625, 0.875, 0.84375, 0.75, 0.75, 0.65625, 0.625, 0.59375, 0.5,
                      0.5])
    h = np.arange(11)
    _, got = mixture_moments(2, 10, np.array([1, 0]), np.array([100.0, 50.0]),
                             np.array([0.5, 0.0]), np.array([5.0, np.nan]), end_points=4,
                             spread=True)
    np.testing.assert_allclose(got[1], (100 + h) * np.sqrt(alive * (1 - alive)))
    np.testing.assert_allclose(got[0], 0.0)


def law_points(m: float, horizon: int, end_points: int, shape: str) -> list[float]:
    """The quantile midpoints of the end-time law with mean m (each below H): uniform on [0,
    2 m] or [2 m - H, H]; or the constant hazard's law on [0, H] with rate x (from
    end_rate, itself checked against root-finding in test_end_rate_*), whose quantile is
    ``-ln(1 - u (1 - e^{-x})) / x`` of H."""
    us = [(j + 0.5) / end_points for j in range(end_points)]
    if shape == "uniform":
        low, high = (0.0, 2 * m) if m <= horizon / 2 else (2 * m - horizon, horizon)
        return [min(low + (high - low) * u, horizon - 1e-9) for u in us]
    x = float(end_rate(np.array([m]), horizon)[0])
    if abs(x) < 1e-9:
        return [min(horizon * u, horizon - 1e-9) for u in us]
    if x > 0:
        return [min(-horizon * np.log1p(-u * -np.expm1(-x)) / x, horizon - 1e-9) for u in us]
    # x < 0: the same quantile written for a large -x without overflow
    return [min(horizon * (1 + np.log(u + (1 - u) * np.exp(x)) / -x), horizon - 1e-9)
            for u in us]


def direct_alive(p_fin, mu, horizon, end_points, shape="exponential"):
    """The mixture law's run probability q[i, h], by its definition, one step at a time:
    1 - p_fin, plus p_fin times the share of the end points (end time with mean mu of
    ``shape``, at its quantile midpoints; all at mu when end_points is 0) still running at
    h. An unknown mu (NaN) runs through the window."""
    q = np.zeros((len(p_fin), horizon + 1))
    for i, (p, m) in enumerate(zip(p_fin, mu, strict=True)):
        m = min(m, horizon - 1e-9) if p > 0 and np.isfinite(m) else horizon - 1e-9
        if end_points == 0:
            points = [m]
        else:
            points = law_points(m, horizon, end_points, shape)
        for h in range(horizon + 1):
            share = 0.0
            for t in points:
                t = min(max(t, 1.0), horizon)
                share += 1.0 if h < np.floor(t) else (t - np.floor(t) if h == np.floor(t) else 0)
            q[i, h] = 1 - p + p * share / len(points)
    return q


@given(seed=st.integers(0, 2**32 - 1), end_points=st.sampled_from([0, 1, 2, 4]),
       workers=st.integers(1, 4), horizon=st.integers(1, 30), n=st.integers(0, 12),
       shape=st.sampled_from(["exponential", "uniform"]))
def test_moments_equal_a_direct_count(seed, end_points, workers, horizon, n, shape):
    """Mean and spread against the law counted step by step (direct_alive): the mean load
    sums (w + h) q, the variance (w + h)^2 q (1 - q), per worker."""
    rng = np.random.default_rng(seed)
    worker = rng.integers(0, workers, n)
    size = rng.integers(1, 3000, n).astype(float)
    p_fin = np.where(rng.uniform(size=n) < 0.2, rng.choice([0.0, 1.0], n), rng.uniform(0, 1, n))
    mu = np.where(rng.uniform(size=n) < 0.1, np.nan, rng.uniform(0.2, horizon + 5, n))
    q = direct_alive(p_fin, mu, horizon, end_points, shape)
    work = size[:, None] + np.arange(horizon + 1)[None, :]
    mean, var = np.zeros((workers, horizon + 1)), np.zeros((workers, horizon + 1))
    np.add.at(mean, worker, work * q)
    np.add.at(var, worker, work ** 2 * q * (1 - q))
    loads, spread = mixture_moments(workers, horizon, worker, size, p_fin, mu,
                                    end_points=end_points, spread=True, end_shape=shape)
    np.testing.assert_allclose(loads, mean, rtol=1e-9, atol=1e-6)
    np.testing.assert_allclose(spread ** 2, var, rtol=1e-9, atol=1e-3)
    assert np.all(spread[var == 0.0] == 0.0)  # exactly: no rounding left where nothing is unsure


def test_spread_is_exactly_zero_where_every_request_is_certain():
    """Large requests (1e5 tokens, w^2 = 1e10) ending surely (p_fin 1) or never (p_fin 0):
    the variance is exactly 0 at every step after they end, not the rounding of prefix sums
    of w^2; an uncertain request on another worker does not leak into these rows."""
    size = np.array([1.0e5, 2.0e5, 1.5e5, 3.0e4])
    worker = np.array([0, 0, 1, 2])
    p_fin = np.array([1.0, 0.0, 1.0, 0.4])
    mu = np.array([7.3, np.nan, 20.0, 5.0])
    _, spread = mixture_moments(3, 60, worker, size, p_fin, mu, spread=True)
    q = direct_alive(p_fin, mu, 60, 4)  # the default law, as mixture_moments
    for g in (0, 1):
        mine = worker == g
        certain = np.all((q[mine] == 0) | (q[mine] == 1), axis=0)
        assert certain.sum() > 10 and np.all(spread[g, certain] == 0.0)
    assert np.all(spread[2, 1:] > 0)


def test_horizon_one_hand_worked():
    """At H = 1 every end point is clipped to 1: the ending share p_fin has ended at step 1
    (size 100, p_fin 0.5: mean 0.5 * 101, spread 101 * 0.5), refilled there by a refill."""
    loads, spread = mixture_moments(1, 1, np.array([0]), np.array([100.0]), np.array([0.5]),
                                    np.array([0.5]), spread=True)
    np.testing.assert_allclose(loads, [[100.0, 50.5]])
    np.testing.assert_allclose(spread, [[0.0, 50.5]])
    refilled = mixture_loads(1, 1, np.array([0]), np.array([100.0]), np.array([0.5]),
                             np.array([0.5]), refill=7.0)
    np.testing.assert_allclose(refilled, [[100.0, 50.5 + 0.5 * 7.0]])


def test_moments_refill_is_the_projection_of_each_end_point():
    """With refill, the mean is the (1 - p_fin) share running through and one projection
    (with its refill) per end point, weighted p_fin / points."""
    for shape in ("exponential", "uniform"):
        for seed, (horizon, points) in enumerate([(2, 1), (5, 3), (16, 4), (40, 4)]):
            _check_refill(seed, horizon, points, shape)


def _check_refill(seed: int, horizon: int, points: int, shape: str) -> None:
    rng = np.random.default_rng(seed)
    workers, n = 3, 20
    worker = rng.integers(0, workers, n)
    size = rng.integers(10, 500, n).astype(float)
    p_fin = np.where(rng.uniform(size=n) < 0.3, rng.choice([0.0, 1.0], n), rng.uniform(0, 1, n))
    mu = rng.uniform(0.3, horizon + 4, n)
    m = np.where(p_fin > 0, np.minimum(mu, horizon - 1e-9), horizon - 1e-9)
    ends = np.array([law_points(mi, horizon, points, shape) for mi in m])
    want = projected_loads(workers, horizon, worker, size, np.full(n, float(horizon)),
                           weight=1 - p_fin)
    for j in range(points):
        want += projected_loads(workers, horizon, worker, size, ends[:, j],
                                weight=p_fin / points, refill=7.0)
    got = mixture_loads(workers, horizon, worker, size, p_fin, mu, refill=7.0,
                        end_points=points, end_shape=shape)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-6)


def test_end_rate_matches_root_finding_on_the_mean():
    """end_rate against scipy's root of the truncated exponential's mean (numerical
    integration), from front-loaded (mean 1 of 80) to loaded towards H (79 of 80); its cdf and
    quantile invert each other and the cdf is the integral of the density."""
    from scipy.integrate import quad
    from scipy.optimize import brentq

    def mean(x: float) -> float:
        return (quad(lambda u: u * np.exp(-x * u), 0, 1)[0]
                / quad(lambda u: np.exp(-x * u), 0, 1)[0])

    horizon = 80
    for mu in (1.0, 2.5, 10.0, 33.0, 40.0, 47.0, 70.0, 79.0):
        want = 0.0 if mu == 40.0 else brentq(lambda x, mu=mu: mean(x) - mu / horizon, -300, 300)
        x = float(end_rate(np.array([mu]), horizon)[0])
        assert x == pytest.approx(want, rel=1e-6, abs=1e-6)
        norm = quad(lambda u, x=x: np.exp(-x * u), 0, 1)[0]
        for s in (0.05, 0.3, 0.7, 0.95):
            integral = quad(lambda u, x=x: np.exp(-x * u), 0, s)[0] / norm
            assert end_cdf(np.array(s), np.array(x)) == pytest.approx(integral, rel=1e-7)
            if integral < 1 - 1e-9:  # (beyond, the cdf is 1 in floating point)
                assert end_quantile(end_cdf(np.array(s), np.array(x)), np.array(x)) == \
                    pytest.approx(s, rel=1e-6)


def test_aged_law_matches_a_monte_carlo_of_the_survivors():
    """A law answered e steps ago, conditioned on the request still running, against a
    simulation: end times drawn from the answer's law (within the window with p_fin, else
    beyond H at the constant hazard p_fin implies), those past e kept, and the share of
    them ending within the next H steps and their mean remaining life measured."""
    rng = np.random.default_rng(7)
    horizon, n = 80, 400_000
    for p, mu, e in [(0.9, 3.0, 5), (0.5, 40.0, 9), (0.2, 30.0, 9), (0.99, 70.0, 9),
                     (0.6, 10.0, 3), (0.3, 60.0, 20)]:
        x = end_rate(np.array([mu]), horizon)
        ends = rng.uniform(size=n) < p
        inside = horizon * end_quantile(rng.uniform(size=n), x)
        beyond = horizon + rng.exponential(horizon / -np.log1p(-p), n)
        remaining = np.where(ends, inside, beyond) - e
        remaining = remaining[remaining > 0]
        p_aged, mu_aged = aged_law(np.array([p]), np.array([mu]), np.array([e]), horizon)
        assert p_aged[0] == pytest.approx(np.mean(remaining <= horizon), abs=0.004)
        assert mu_aged[0] == pytest.approx(remaining[remaining <= horizon].mean(), rel=0.01)
    # nothing elapsed, no law (NaN), or nothing to end: the answer as given
    p_aged, mu_aged = aged_law(np.array([0.4, 0.0, 0.5]), np.array([7.0, np.nan, np.nan]),
                               np.array([0, 5, 5]), horizon)
    np.testing.assert_array_equal(p_aged[:2], [0.4, 0.0])
    assert mu_aged[0] == 7.0 and np.isnan(mu_aged[1])
    # the uniform option: p_fin kept, mu_rem moved e closer, at least 1
    p_u, mu_u = aged_law(np.array([0.9, 0.5]), np.array([3.0, 40.0]), np.array([5, 9]),
                         horizon, shape="uniform")
    np.testing.assert_array_equal(p_u, [0.9, 0.5])
    np.testing.assert_array_equal(mu_u, [1.0, 31.0])
