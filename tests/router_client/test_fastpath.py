"""BR-0's fast Stage 1 (router_client.fastpath) makes exactly the reference's decisions."""

from dataclasses import replace
from functools import partial
from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.cli import bundled_trace
from router_client import admission
from router_client.admission import (
    GUARD_RULES,
    STAGE1_RULES,
    STAGE2_ORDERS,
    BalanceRouteParams,
    route_round,
)
from router_client.fleet import FleetView, WaitingRequest
from router_client.fscore import MarginTable, discounts
from router_client.policies import make_policy
from router_client.simulator import SimConfig, simulate
from router_client.synth import synthesize
from router_client.traces import load_trace


def fleet_and_pool(seed, workers, capacity, pool_size, size_range, free_share=None):
    """A random fleet and pool; with ``free_share``, about that share of the slots free (a
    saturated steady state)."""
    rng = np.random.default_rng(seed)
    if free_share is None:
        counts = rng.integers(0, capacity + 1, workers)
    else:
        counts = capacity - rng.binomial(capacity, free_share, workers)
    worker = np.repeat(np.arange(workers), counts)
    size = rng.integers(1, size_range, worker.size).astype(float)
    fleet = FleetView.from_active(workers, capacity, worker, size, None)
    pool = [WaitingRequest(i, int(s)) for i, s in enumerate(rng.integers(0, size_range,
                                                                         pool_size))]
    return fleet, pool


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), workers=st.integers(1, 12), capacity=st.integers(1, 12),
       pool_size=st.integers(0, 60), size_range=st.sampled_from([3, 20, 6000]),
       stage1=st.sampled_from(STAGE1_RULES), s_greedy=st.integers(0, 8),
       candidates=st.sampled_from([1, 3, 1024]), r_max=st.integers(1, 6),
       count_weight=st.sampled_from([0.0, 1.0, 7.0, 0.3]), order=st.sampled_from(STAGE2_ORDERS),
       fill=st.booleans(), guard=st.sampled_from(GUARD_RULES),
       overhead=st.sampled_from([None, 0.0, 10.0, 500.0, float("inf")]),
       down=st.booleans(), patience=st.sampled_from([None, 0, 1, 3]), revisit=st.booleans())
def test_fast_stage1_same_decisions_as_reference(seed, workers, capacity, pool_size,
                                                 size_range, stage1, s_greedy, candidates,
                                                 r_max, count_weight, order, fill, guard,
                                                 overhead, down, patience, revisit):
    # small size ranges force ties in F, in load and in size (and, with a count weight, in
    # load + weight * active requests); the guard idle's fixed cost from 0 (it waits most)
    # to inf (never), worker 0 down as the proxy shows it (full, marked down), and workers
    # that have waited 0-3 rounds in a row against a patience of 0-3 rounds (or none)
    fleet, pool = fleet_and_pool(seed, workers, capacity, pool_size, size_range)
    if down:
        mask = np.arange(workers) == 0
        fleet = replace(fleet, active_counts=np.where(mask, capacity, fleet.active_counts),
                        down=mask)
    params = BalanceRouteParams.br0(stage1=stage1, s_greedy=s_greedy,
                                    stage1_candidates=candidates, r_max=r_max,
                                    lpt_count_weight=count_weight, stage2_order=order,
                                    stage2_fill=fill, guard=guard, step_overhead=overhead,
                                    patience=patience, stage2_revisit=revisit)
    waited = np.random.default_rng(seed + 1).integers(0, 4, workers)
    want, want_stats = route_round(fleet, pool, params, reference=True, waited=waited)
    got, got_stats = route_round(fleet, pool, params, reference=False, waited=waited)
    assert got == want
    assert got_stats.revisit_admissions == want_stats.revisit_admissions
    assert got_stats.stage1_admissions == want_stats.stage1_admissions
    assert got_stats.starvation_guard_admissions == want_stats.starvation_guard_admissions
    assert got_stats.waited == want_stats.waited
    assert got_stats.patience_admissions == want_stats.patience_admissions
    if patience is not None:  # a worker out of patience is never held back
        assert not [w for w in got_stats.waited if waited[w] >= patience]


@pytest.mark.parametrize(("stage1", "order", "fill", "guard"),
                         [("auto", "slots", False, "always"),
                          ("auto-pair", "slots", False, "always"),
                          ("auto", "margin", False, "always"), ("auto", "slots", True, "always"),
                          ("auto", "margin", True, "always"), ("auto", "slots", False, "idle"),
                          ("auto", "margin", True, "idle"), ("auto", "slots", False, "idle0")])
@pytest.mark.parametrize(("load", "workers"), [("backlog", 4), (0.8, 8), (1.0, 3)])
def test_ab_rows_unchanged_by_the_fast_path(monkeypatch, load, workers, stage1, order, fill,
                                            guard):
    # "idle0": the guard idle on a step without fixed cost (b = 0), where it waits most
    trace = synthesize("synth:long:n=600,seed=3")
    step_cost = (1.5e-7, 0.0) if guard == "idle0" else (1.5e-7, 0.010)
    guard = "idle" if guard == "idle0" else guard
    config = SimConfig(workers=workers, batch=8, load=load, seed=1, step_cost=step_cost)
    params = BalanceRouteParams.br0(stage1=stage1, stage2_order=order, stage2_fill=fill,
                                    guard=guard)
    fast = simulate(trace, make_policy("br0", params=params), config).row
    monkeypatch.setattr(admission, "FAST_PATH", False)
    slow = simulate(trace, make_policy("br0", params=params), config).row
    fast.pop("sim_wall_s")
    slow.pop("sim_wall_s")
    assert fast == slow


@pytest.mark.parametrize("stage1", ["paper", "best-pair"])
@pytest.mark.parametrize("sizes", [[12, 8, 8, 12], [8, 12, 12, 8], [9, 9, 7, 13]])
def test_fast_stage1_breaks_ties_between_the_two_sides_like_the_reference(stage1, sizes):
    # worker 0: load 0, margin 10; F(8) = 8 = F(12) = 12 - 2 * (12 - 10)
    fleet = FleetView.from_active(2, 4, np.array([1]), np.array([10.0]), None)
    pool = [WaitingRequest(i, s) for i, s in enumerate(sizes)]
    params = BalanceRouteParams.br0(stage1=stage1, s_greedy=0)
    want, _ = route_round(fleet, pool, params, reference=True)
    assert route_round(fleet, pool, params, reference=False)[0] == want
    assert want[0].pool_index == 0


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), free_share=st.sampled_from([0.002, 0.01, 0.03]),
       pool_size=st.sampled_from([300, 4096]), size_range=st.sampled_from([4, 50, 6000]),
       stage1=st.sampled_from(STAGE1_RULES), order=st.sampled_from(STAGE2_ORDERS),
       fill=st.booleans(), guard=st.sampled_from(GUARD_RULES),
       overhead=st.sampled_from([None, 0.0]))
def test_fast_path_same_decisions_at_g256(seed, free_share, pool_size, size_range, stage1,
                                          order, fill, guard, overhead):
    # the bench's scale: G = 256, B = 64, pool 4096 (a round reads only its head), or a pool
    # shorter than the free slots (about 330 or 490 at the larger shares: auto is lpt);
    # small size ranges force ties in F, load and size (revisits: the small fleets above,
    # here a worker rarely has a second free slot)
    fleet, pool = fleet_and_pool(seed, 256, 64, pool_size, size_range, free_share)
    params = BalanceRouteParams.br0(stage1=stage1, stage2_order=order, stage2_fill=fill,
                                    guard=guard, step_overhead=overhead)
    want, want_stats = route_round(fleet, pool, params, reference=True)
    got, got_stats = route_round(fleet, pool, params, reference=False)
    assert got == want
    assert got_stats.stage1_admissions == want_stats.stage1_admissions


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), workers=st.integers(2, 12), capacity=st.integers(1, 8),
       pool_size=st.integers(0, 300), size_range=st.sampled_from([3, 20, 6000]),
       stage1=st.sampled_from(STAGE1_RULES), candidates=st.integers(1, 40),
       r_max=st.integers(1, 40))
def test_reading_only_the_reachable_head_of_a_long_pool_changes_nothing(
        seed, workers, capacity, pool_size, size_range, stage1, candidates, r_max):
    fleet, pool = fleet_and_pool(seed, workers, capacity, pool_size, size_range)
    params = BalanceRouteParams.br0(stage1=stage1, stage1_candidates=candidates, r_max=r_max)
    head = admission.reachable_head(len(pool), params, workers, int(fleet.free_slots.sum()))
    want, _ = route_round(fleet, pool, params, reference=True)
    assert route_round(fleet, pool, params, reference=False)[0] == want
    assert all(a.pool_index < head for a in want)  # nothing past the head is ever admitted


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), workers=st.integers(1, 8), capacity=st.integers(1, 6),
       pool_size=st.integers(0, 80), candidates=st.integers(1, 12), r_max=st.integers(1, 6),
       candidate_life=st.booleans(), refill=st.booleans(), pool_c_hat=st.booleans(),
       stage1=st.sampled_from(STAGE1_RULES))
def test_brh_reads_the_same_head_and_decides_like_the_reference(
        seed, workers, capacity, pool_size, candidates, r_max, candidate_life, refill,
        pool_c_hat, stage1):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, capacity + 1, workers)
    worker = np.repeat(np.arange(workers), counts)
    size = rng.integers(1, 3000, worker.size).astype(float)
    fleet = FleetView.from_active(workers, capacity, worker, size,
                                  rng.uniform(1, 20, worker.size))
    if pool_c_hat:
        fleet = replace(fleet, pool_c_hat=rng.uniform(1, 25, pool_size))
    pool = [WaitingRequest(i, int(s)) for i, s in enumerate(rng.integers(1, 3000, pool_size))]
    params = BalanceRouteParams(horizon=16, stage1=stage1, stage1_candidates=candidates,
                                r_max=r_max, candidate_life=candidate_life, refill=refill)
    want, _ = route_round(fleet, pool, params, reference=True)
    assert route_round(fleet, pool, params, reference=False)[0] == want


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 12), max_count=st.integers(1, 12),
       horizon=st.sampled_from([1, 5, 80]), scale=st.sampled_from([3.0, 1e3, 1e6]),
       integer=st.booleans())
def test_vectorized_row_subset_enumeration_equals_the_reference(seed, n, max_count, horizon,
                                                                scale, integer):
    # up to 12 members (numpy's pairwise summation starts at 8): the same sums bit for bit,
    # hence the same choice; integer rows force ties in F and in the added work
    rng = np.random.default_rng(seed)
    rows = rng.random((n, horizon + 1)) * scale
    if integer:
        rows = np.floor(rows)
    loads = np.floor(rng.random((3, horizon + 1)) * scale * 3)
    table = MarginTable(loads, discounts(horizon, 0.9), 1.0, 3.0)
    score = partial(table.score_rows, 0)
    want = admission._best_row_subset(rows, max_count, score)
    assert admission._best_row_subset(rows, max_count, score, fast=True) == want
    # stage2_fill: the most requests that fit now (at the worker's margin), then the best F
    margin = table.current_margin(0)
    want = admission._best_row_subset(rows, max_count, score, fit_margin=margin)
    assert admission._best_row_subset(rows, max_count, score, fast=True,
                                      fit_margin=margin) == want
    fitting = [c for j in range(1, min(max_count, n) + 1) for c in combinations(range(n), j)
               if rows[list(c), 0].sum() <= margin]
    if fitting and max(map(len, fitting)) <= max_count:
        assert len(want.indices) == max(map(len, fitting))
        assert rows[list(want.indices), 0].sum() <= margin


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_count=st.integers(4, 6),
       scale=st.sampled_from([20.0, 1e3]))
def test_greedy_row_subset_past_enumeration(seed, max_count, scale):
    """Past :data:`admission.MAX_ENUMERATED_SUBSETS` (20 candidates, room for 4 or more), the
    greedy choice stops where no remaining request raises F; with ``fit_margin`` it keeps
    every added total within the margin now and stops only when no remaining request fits."""
    rng = np.random.default_rng(seed)
    rows = np.floor(rng.random((20, 6)) * scale)
    table = MarginTable(np.floor(rng.random((3, 6)) * scale * 4), discounts(5, 0.9), 1.0, 3.0)
    score = partial(table.score_rows, 0)
    plain = admission._best_row_subset(rows, max_count, score)
    total = rows[list(plain.indices)].sum(axis=0)
    assert plain.score == pytest.approx(float(score(total[None, :])[0]))
    rest = [i for i in range(20) if i not in plain.indices]
    if len(plain.indices) < max_count:
        assert all(score((total + rows[i])[None, :])[0] <= plain.score for i in rest)
    margin = table.current_margin(0)
    if rows[:, 0].min() <= margin:
        fill = admission._best_row_subset(rows, max_count, score, fit_margin=margin)
        used = rows[list(fill.indices), 0].sum()
        assert used <= margin
        if len(fill.indices) < max_count:
            assert all(used + rows[i, 0] > margin for i in range(20) if i not in fill.indices)


@pytest.mark.parametrize("reference", [True, False])
def test_stage2_revisit_takes_the_room_a_later_admission_made(reference):
    """Loads 80, 60 (full), 0 with 1, 0, 2 free slots; pool 60, 70, 80, 50; BR-0 (beta = G =
    3, widest margin first, BF-IO's subset rule; F of D tokens at margin m is D up to m, D -
    3 (D - m) above it). Worker 2 (margin 80) takes 80, the largest that fits (no two fit
    together). Worker 0 (margin 0) fits nothing: the guard admits 50 (F -100, the best), and
    the maximum rises to 130. Without revisits the round ends there and 60 and 70 wait. With
    ``stage2_revisit`` worker 2 (a slot left, margin now 50) is taken again after the first
    visits: nothing fits, F(60) = 60 - 3 * 10 = 30 and F(70) = 70 - 3 * 20 = 10, so it takes
    60; a revisit forces nothing."""
    fleet = FleetView.from_active(3, 2, np.array([0, 1, 1]), np.array([80.0, 30.0, 30.0]),
                                  None)
    pool = [WaitingRequest(i, s) for i, s in enumerate((60, 70, 80, 50))]
    once = route_round(fleet, pool, BalanceRouteParams.br0(s_greedy=8), reference=reference)
    again = route_round(fleet, pool, BalanceRouteParams.br0(s_greedy=8, stage2_revisit=True),
                        reference=reference)
    assert [(a.pool_index, a.worker, a.starvation_guard) for a in once[0]] == [
        (2, 2, False), (3, 0, True)]
    assert [(a.pool_index, a.worker, a.starvation_guard) for a in again[0]] == [
        (2, 2, False), (3, 0, True), (0, 2, False)]
    assert again[1].starvation_guard_admissions == 1
    # a revisit that finds nothing with F > 0 admits nothing (no guard): pool 75, 80, 50, 200,
    # the first visits as above; worker 2's revisit scores F(75) = 75 - 3 * 25 = 0 and
    # F(200) = 200 - 3 * 150 < 0, so 75 and 200 wait
    pool = [WaitingRequest(i, s) for i, s in enumerate((75, 80, 50, 200))]
    got = route_round(fleet, pool, BalanceRouteParams.br0(s_greedy=8, stage2_revisit=True),
                      reference=reference)
    assert [(a.pool_index, a.worker) for a in got[0]] == [(1, 2), (2, 0)]
    assert got[1].starvation_guard_admissions == 1


@pytest.mark.parametrize(("load", "batch", "order"), [("backlog", 16, "margin"),
                                                      ("backlog", 16, "slots"),
                                                      (1.0, 8, "margin")])
def test_ab_rows_with_stage2_revisits_unchanged_by_the_fast_path(monkeypatch, load, batch,
                                                                 order):
    """The bundled Azure trace's first 1,200 requests at G = 4, where revisits act (the rows
    move with them): the fast path's rows equal the reference's."""
    trace = load_trace(str(bundled_trace()), requests=1200)
    config = SimConfig(workers=4, batch=batch, load=load, seed=1)
    params = BalanceRouteParams.br0(stage2_order=order, stage2_revisit=True)

    def rows(params):
        row = simulate(trace, make_policy("br0", params=params), config).row
        row.pop("sim_wall_s")
        return row

    fast = rows(params)
    once = rows(replace(params, stage2_revisit=False))
    assert fast != once  # revisits acted, and the rows count them
    assert fast["stage2_revisit_admissions"] > 0 == once["stage2_revisit_admissions"]
    monkeypatch.setattr(admission, "FAST_PATH", False)
    assert rows(params) == fast


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), workers=st.integers(2, 8), capacity=st.integers(1, 8),
       pool_size=st.integers(0, 40), size_range=st.sampled_from([3, 20, 6000]),
       s_greedy=st.sampled_from([0, 7, 100]), r_max=st.integers(1, 6),
       order=st.sampled_from(STAGE2_ORDERS), fill=st.booleans(),
       guard=st.sampled_from(GUARD_RULES), reference=st.booleans())
def test_stage2_revisits_only_add_admissions_that_pay_after_the_first_visits(
        seed, workers, capacity, pool_size, size_range, s_greedy, r_max, order, fill, guard,
        reference):
    """Revisits come after every worker's first visit: a round with them routes the round
    without them first (the same assignments, in the same order), then adds admissions that
    are never the guard's, each onto a worker that had taken a request this round other than
    by the guard (the reference and the fast path alike)."""
    fleet, pool = fleet_and_pool(seed, workers, capacity, pool_size, size_range)
    params = BalanceRouteParams.br0(s_greedy=s_greedy, r_max=r_max, stage2_order=order,
                                    stage2_fill=fill, guard=guard)
    once, once_stats = route_round(fleet, pool, params, reference=reference)
    again, again_stats = route_round(fleet, pool, replace(params, stage2_revisit=True),
                                     reference=reference)
    assert again[:len(once)] == once
    added = again[len(once):]
    assert again_stats.revisit_admissions == len(added)
    assert once_stats.revisit_admissions == 0
    assert not any(a.starvation_guard for a in added)
    assert again_stats.starvation_guard_admissions == once_stats.starvation_guard_admissions
    assert again_stats.waited == once_stats.waited
    first_visit_takers = {a.worker for a in once if not a.starvation_guard}
    assert {a.worker for a in added} <= first_visit_takers
