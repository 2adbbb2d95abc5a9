import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router_client.fscore import MarginTable, br0_score, direct_score, discounts


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
