from itertools import combinations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from router_client.fscore import MarginTable, discounts
from router_client.subset import best_subset, reachable_tables


def brute_force(sizes, max_count, score):
    best = None
    for k in range(1, min(max_count, len(sizes)) + 1):
        for combo in combinations(range(len(sizes)), k):
            value = float(score(np.array([sum(sizes[i] for i in combo)], dtype=float))[0])
            if best is None or value > best:
                best = value
    return best


@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=10),
    max_count=st.integers(1, 10),
    horizon=st.integers(0, 20),
    beta=st.floats(0.0, 40.0),
    gamma=st.floats(0.5, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_best_subset_equals_brute_force(sizes, max_count, horizon, beta, gamma, seed):
    rng = np.random.default_rng(seed)
    workers = 4
    loads = rng.integers(0, 6000, size=(workers, horizon + 1)).astype(float)
    alpha = 1.0
    if horizon == 0:
        beta = float(workers)
    table = MarginTable(loads, discounts(horizon, gamma), alpha, beta)
    for worker in range(workers):
        def score(D, worker=worker):
            return table.score(worker, D)
        choice = best_subset(sizes, max_count, score, table.peak(worker))
        want = brute_force(sizes, max_count, score)
        assert choice is not None
        assert 1 <= len(choice.indices) <= min(max_count, len(sizes))
        assert len(set(choice.indices)) == len(choice.indices)
        assert choice.total == sum(sizes[i] for i in choice.indices)
        assert abs(choice.score - float(score(np.array([choice.total]))[0])) < 1e-6
        assert abs(choice.score - want) <= 1e-6 * max(1.0, abs(want))
        # bitsets cut past peak + max size: the very same choice
        assert best_subset(sizes, max_count, score, table.peak(worker), truncate=True) == choice


@given(sizes=st.lists(st.integers(0, 50), min_size=0, max_size=8), max_count=st.integers(0, 8))
def test_reachable_tables_match_enumeration(sizes, max_count):
    final = reachable_tables(sizes, max_count)[-1]
    for j in range(max_count + 1):
        want = {sum(c) for c in combinations(sizes, j)} if j <= len(sizes) else set()
        got = {b for b in range(final[j].bit_length()) if (final[j] >> b) & 1}
        assert got == want


def test_prefers_more_requests_for_the_same_total():
    choice = best_subset([1000, 400, 600], 3, lambda D: D - 8 * np.maximum(0, D - 1000), 1000)
    assert choice is not None and choice.total == 1000 and choice.indices == (1, 2)


def test_empty_candidates():
    assert best_subset([], 4, lambda D: D, 10.0) is None
    assert best_subset([5], 0, lambda D: D, 10.0) is None


@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=9),
    max_count=st.integers(1, 9),
    load=st.integers(0, 9000),
    top=st.integers(0, 9000),
)
def test_fill_slots_takes_the_most_requests_that_fit_then_the_largest_total(sizes, max_count,
                                                                            load, top):
    """BF-IO's subset rule (``fill_slots``), against enumeration: of the subsets of at most
    ``max_count`` whose total stays within the margin, the most requests, then the largest
    total; where none does, the F-best subset (as without the rule)."""
    workers = 4
    loads = np.array([[float(load)], [float(max(load, top))], [0.0], [0.0]])
    table = MarginTable(loads, discounts(0, 1.0), 1.0, float(workers))
    margin = table.peak(0)

    def score(D):
        return table.score(0, D)

    fitting = [(len(c), sum(sizes[i] for i in c))
               for k in range(1, min(max_count, len(sizes)) + 1)
               for c in combinations(range(len(sizes)), k)
               if sum(sizes[i] for i in c) <= margin]
    for truncate in (False, True):
        choice = best_subset(sizes, max_count, score, margin, truncate=truncate,
                             fill_slots=True)
        assert choice is not None
        assert choice.total == sum(sizes[i] for i in choice.indices)
        if fitting:
            assert (len(choice.indices), choice.total) == max(fitting)
        else:
            assert choice == best_subset(sizes, max_count, score, margin, truncate=truncate)
