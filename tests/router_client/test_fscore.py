import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.integrate import quad

from router_client.fscore import (
    MarginTable,
    br0_score,
    direct_score,
    discounts,
    expected_overflow,
)


@pytest.mark.parametrize(
    ("D", "want"), [(900, 900), (1000, 1000), (1100, 300), (1200, -400), (0, 0)]
)
def test_spec_worked_example(D, want):
    # the paper's BR-0 example: G = 8, m_g = 1000.
    assert br0_score(D, 1000, 8) == want


def test_br0_table_matches_worked_example():
    loads = np.array([[5000.0], [4000.0]] + [[5000.0]] * 6)  # worker 1 has margin 1000
    table = MarginTable(loads, discounts(0, 1.0), alpha=1.0, beta=8.0)
    got = table.score(1, np.array([900, 1000, 1100, 1200]))
    np.testing.assert_allclose(got, [900, 1000, 300, -400])


@given(
    seed=st.integers(0, 2**32 - 1),
    workers=st.integers(1, 8),
    horizon=st.integers(0, 40),
    gamma=st.floats(0.5, 1.0),
    beta=st.floats(0.0, 64.0),
    alpha=st.floats(0.1, 3.0),
)
def test_fast_score_equals_direct_sum(seed, workers, horizon, gamma, beta, alpha):
    rng = np.random.default_rng(seed)
    loads = rng.integers(0, 5000, size=(workers, horizon + 1)).astype(float)
    d = discounts(horizon, gamma)
    table = MarginTable(loads, d, alpha, beta)
    D = np.concatenate([rng.integers(0, 8000, 20), table.margins(0)]).astype(float)
    for worker in range(workers):
        want = direct_score(D, table.margins(worker), d, alpha, beta)
        np.testing.assert_allclose(table.score(worker, D), want, rtol=1e-9, atol=1e-6)
    # after admissions the incremental update still agrees with a fresh table
    for _ in range(3):
        worker = int(rng.integers(0, workers))
        table.admit(worker, float(rng.integers(0, 3000)))
    fresh = MarginTable(table.loads, d, alpha, beta)
    for worker in range(workers):
        np.testing.assert_allclose(table.score(worker, D), fresh.score(worker, D), atol=1e-6)
        np.testing.assert_allclose(
            table.score(worker, D), direct_score(D, fresh.margins(worker), d, alpha, beta),
            rtol=1e-9, atol=1e-6,
        )


@given(seed=st.integers(0, 2**32 - 1), horizon=st.integers(0, 30), beta=st.floats(0.0, 50.0))
def test_peak_is_the_maximum_of_F(seed, horizon, beta):
    rng = np.random.default_rng(seed)
    loads = rng.integers(0, 3000, size=(3, horizon + 1)).astype(float)
    table = MarginTable(loads, discounts(horizon, 0.9), 1.0, beta)
    grid = np.arange(0, 8000, dtype=float)
    for worker in range(3):
        peak = table.peak(worker)
        values = table.score(worker, grid)
        if np.isinf(peak):
            assert np.all(np.diff(values) >= -1e-9)
        else:
            assert table.score(worker, peak) >= values.max() - 1e-6


@pytest.mark.parametrize(("x", "sigma"), [(-300.0, 100.0), (-50.0, 100.0), (0.0, 100.0),
                                          (80.0, 40.0), (500.0, 100.0), (7.0, 0.0),
                                          (-7.0, 0.0)])
def test_expected_overflow_against_numerical_integration(x, sigma):
    if sigma == 0:
        assert expected_overflow(np.array(x), np.array(0.0)) == max(0.0, x)
        return
    want, _ = quad(lambda e: max(0.0, x + e) * np.exp(-0.5 * (e / sigma) ** 2)
                   / (sigma * np.sqrt(2 * np.pi)), -12 * sigma, 12 * sigma, points=[-x],
                   limit=200)
    assert float(expected_overflow(np.array(x), np.array(sigma))) == pytest.approx(want, rel=1e-7)


def test_a_spread_raises_the_penalty_only_where_loads_are_uncertain():
    # Two workers, H = 3; worker 0's future loads are uncertain (sigma 200 at h >= 1).
    loads = np.array([[1000.0, 900.0, 800.0, 700.0], [1500.0, 1500.0, 1500.0, 1500.0]])
    d = discounts(3, 0.8)
    spread = np.array([[0.0, 200.0, 200.0, 200.0], [0.0, 0.0, 0.0, 0.0]])
    known = MarginTable(loads, d, 1.0, 2.0)
    unsure = MarginTable(loads, d, 1.0, 2.0, spread)
    rows = np.array([[400.0, 500.0, 600.0, 700.0], [100.0, 100.0, 100.0, 100.0]])
    for worker in (0, 1):
        margins = known.margins(worker)
        over = expected_overflow(rows - margins, spread[worker])
        want = rows @ d - 2.0 * (over @ d)
        np.testing.assert_allclose(unsure.score_rows(worker, rows), want)
    np.testing.assert_allclose(unsure.score_rows(1, rows), known.score_rows(1, rows))
    assert (unsure.score_rows(0, rows) < known.score_rows(0, rows)).all()  # Jensen
    # a constant D is a constant row; the peak is not defined with a spread
    np.testing.assert_allclose(unsure.score(0, np.array([400.0])),
                               unsure.score_rows(0, np.full((1, 4), 400.0)))
    with pytest.raises(ValueError):
        unsure.peak(0)


@given(st.integers(0, 10_000), st.booleans())
def test_score_row_workers_equals_score_rows_worker_by_worker(seed, with_spread):
    """The vectorized score of one row on several workers (BR-H's lpt placement) is
    :meth:`MarginTable.score_rows` on each worker: with known loads and with a spread."""
    rng = np.random.default_rng(seed)
    workers, horizon = int(rng.integers(2, 9)), int(rng.integers(0, 12))
    loads = rng.uniform(0, 5000, (workers, horizon + 1))
    spread = rng.uniform(0, 300, loads.shape) if with_spread else None
    table = MarginTable(loads, discounts(horizon, float(rng.uniform(0.5, 1.0))),
                        1.0, float(workers), spread)
    row = rng.uniform(0, 4000, horizon + 1)
    chosen = np.sort(rng.choice(workers, size=int(rng.integers(1, workers + 1)),
                                replace=False))
    want = np.array([float(table.score_rows(int(g), row)) for g in chosen])
    np.testing.assert_allclose(table.score_row_workers(chosen, row), want,
                               rtol=1e-12, atol=1e-6)


@pytest.mark.parametrize("copies", [2, 3, 5, 6, 7, 9, 17])
def test_score_row_workers_scores_workers_in_the_same_state_exactly_alike(copies):
    """Identical workers get bit-identical scores, whatever their number (a BLAS matrix
    product can round identical rows differently, which would decide a tie by rounding)."""
    rng = np.random.default_rng(copies)
    horizon = 80
    base = rng.uniform(0, 5000, horizon + 1)
    loads = np.vstack([base] * copies + [base + 3000.0])  # the last worker sets the envelope
    table = MarginTable(loads, discounts(horizon, 0.95), 1.0, float(copies + 1))
    row = rng.uniform(2000, 6000, horizon + 1)  # overflows the identical workers' margins
    scores = table.score_row_workers(np.arange(copies), row)
    assert (scores == scores[0]).all()
    assert scores[0] == pytest.approx(float(table.score_rows(0, row)), rel=1e-12)


def test_the_marginal_overflow_is_the_rise_the_added_work_causes():
    """``marginal``: the penalty is E[max(0, w + e - m)] - E[max(0, e - m)] (checked against
    numerical integration of the difference); adding nothing then scores 0 exactly; every
    row of one worker moves by the same amount (its own expected overflow), so their order is
    the absolute score's; without a spread nothing changes."""
    loads = np.array([[1000.0, 950.0, 900.0], [1200.0, 1100.0, 1000.0]])
    d = discounts(2, 0.8)
    spread = np.array([[0.0, 150.0, 250.0], [0.0, 100.0, 300.0]])
    absolute = MarginTable(loads, d, 1.0, 2.0, spread)
    marginal = MarginTable(loads, d, 1.0, 2.0, spread, marginal=True)
    rows = np.array([[0.0, 0.0, 0.0], [100.0, 101.0, 102.0], [300.0, 301.0, 302.0],
                     [700.0, 701.0, 0.0]])
    for worker in (0, 1):
        margins = absolute.margins(worker)
        want = []
        for row in rows:
            rise = 0.0
            for h in range(3):
                s, m, w = spread[worker, h], margins[h], row[h]
                if s == 0:
                    part = max(0.0, w - m) - max(0.0, -m)
                else:
                    part, _ = quad(lambda e, w=w, m=m, s=s: (max(0.0, w + e - m)
                                                              - max(0.0, e - m))
                                   * np.exp(-0.5 * (e / s) ** 2) / (s * np.sqrt(2 * np.pi)),
                                   -12 * s, 12 * s, points=[m - w, m], limit=200)
                rise += d[h] * part
            want.append(row @ d - 2.0 * rise)
        got = marginal.score_rows(worker, rows)
        np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-6)
        assert got[0] == 0.0
        shift = got - absolute.score_rows(worker, rows)
        np.testing.assert_allclose(shift, shift[0], rtol=1e-12)
        assert shift[0] > 0  # the worker's own expected overflow, no longer charged
    known = MarginTable(loads, d, 1.0, 2.0, marginal=True)
    np.testing.assert_array_equal(known.score_rows(1, rows),
                                  MarginTable(loads, d, 1.0, 2.0).score_rows(1, rows))
