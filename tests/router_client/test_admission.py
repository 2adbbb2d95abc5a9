import dataclasses
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from scipy.integrate import quad
from scipy.optimize import brentq

from proxy.dispatcher import RankMaskPolicy
from router_client.admission import (
    DEFAULT_STEP_OVERHEAD,
    STAGE1_RULES,
    BalanceRouteParams,
    arrival_fill_growth,
    build_table,
    route_round,
    turnover_gamma,
)
from router_client.errors import ParameterError, UnknownPolicyError
from router_client.fleet import ArrivalRate, FleetView, WaitingRequest
from router_client.fscore import candidate_rows
from router_client.policies import BalanceRoutePolicy, make_policy
from router_client.simulator import DEFAULT_STEP_COST

ALL = ["random", "rr", "jsq", "p2c", "ltl", "br0", "brh-oracle"]


def random_fleet(rng, workers, capacity, with_c_hat=True, horizon=80):
    counts = rng.integers(0, capacity + 1, workers)
    worker = np.repeat(np.arange(workers), counts)
    size = rng.integers(1, 5000, worker.size).astype(float)
    c_hat = rng.uniform(1, horizon, worker.size) if with_c_hat else None
    return FleetView.from_active(workers, capacity, worker, size, c_hat)


def random_pool(rng, n):
    return [WaitingRequest(f"r{i}", int(s)) for i, s in enumerate(rng.integers(0, 6000, n))]


@given(seed=st.integers(0, 2**32 - 1), workers=st.integers(1, 6), capacity=st.integers(1, 6),
       pool_size=st.integers(0, 40), policy=st.sampled_from(ALL),
       stage1=st.sampled_from(STAGE1_RULES), guard=st.sampled_from([None, "always", "idle"]))
@example(seed=0, workers=6, capacity=1, pool_size=1, policy="brh-oracle", stage1="paper",
         guard=None)  # (three empty workers, BR-H once left them all empty)
def test_round_invariants(seed, workers, capacity, pool_size, policy, stage1, guard):
    rng = np.random.default_rng(seed)
    fleet = random_fleet(rng, workers, capacity)
    pool = random_pool(rng, pool_size)
    params = BalanceRouteParams(stage1=stage1, s_greedy=int(rng.integers(0, 8)), guard=guard)
    decision = make_policy(policy, seed=seed, params=params).route(fleet, pool)
    indices = [a.pool_index for a in decision.assignments]
    assert len(indices) == len(set(indices)), "a request assigned twice"
    assert all(0 <= i < len(pool) for i in indices), "assigned a request not in the pool"
    per_worker = np.bincount([a.worker for a in decision.assignments], minlength=workers)
    assert np.all(fleet.active_counts + per_worker <= capacity), "a worker above B"
    # work conservation: every policy fills what it can (the starvation guard ensures it);
    # under the guard idle a round may leave every slot empty, but never an empty worker's
    free = int(fleet.free_slots.sum())
    empty_with_room = bool(((fleet.active_counts == 0) & (fleet.free_slots > 0)).any())
    guard_idle = (make_policy(policy, params=params).params.effective_guard == "idle"
                  if policy in ("br0", "brh-oracle") else False)
    if policy in ("random", "rr", "jsq", "p2c", "ltl"):
        assert len(indices) == min(free, pool_size)
    elif empty_with_room or not guard_idle:
        assert len(indices) >= min(1, free, pool_size)
    if policy in ("br0", "brh-oracle") and len(indices) < pool_size:
        # requests still wait: under "always" every worker with a free slot took one; under
        # "idle" every worker that held nothing did (the guard never holds back an empty
        # worker, so no request waits for ever)
        took = set(per_worker.nonzero()[0].tolist())
        room = fleet.free_slots > 0
        must = room & (fleet.active_counts == 0) if guard_idle else room
        assert set(np.flatnonzero(must).tolist()) <= took


@given(seed=st.integers(0, 2**32 - 1), workers=st.integers(1, 8), capacity=st.integers(1, 8),
       pool_size=st.integers(0, 30), stage1=st.sampled_from(STAGE1_RULES),
       gamma=st.floats(0.1, 1.0))
def test_brh_with_h0_alpha1_betaG_is_br0(seed, workers, capacity, pool_size, stage1, gamma):
    rng = np.random.default_rng(seed)
    fleet = random_fleet(rng, workers, capacity, with_c_hat=True)
    without = FleetView(fleet.capacity, fleet.loads, fleet.active_counts, fleet.active_worker,
                        fleet.active_size, None)
    pool = random_pool(rng, pool_size)
    br0 = BalanceRouteParams.br0(stage1=stage1)
    brh = BalanceRouteParams(horizon=0, alpha=1.0, beta=float(workers), gamma=gamma,
                             stage1=stage1)
    want, _ = route_round(without, pool, br0)
    got, _ = route_round(fleet, pool, brh)  # goes through the projection with c_hat
    assert got == want


def test_br0_forces_beta_equal_to_G():
    fleet = random_fleet(np.random.default_rng(0), 4, 4)
    pool = random_pool(np.random.default_rng(1), 3)
    with pytest.raises(ParameterError, match="beta"):
        route_round(fleet, pool, BalanceRouteParams(horizon=0, beta=5.0))
    with pytest.raises(ParameterError, match="alpha"):
        BalanceRouteParams(horizon=0, alpha=2.0)
    assert BalanceRouteParams.br0().effective_beta(16) == 16.0


def turnover_fleet(c_hat, p_fin=None):
    worker = np.array([0, 0, 1, 1])
    fleet = FleetView.from_active(2, 8, worker, np.full(4, 100.0), np.asarray(c_hat, float))
    if p_fin is None:
        return fleet
    return FleetView(fleet.capacity, fleet.loads, fleet.active_counts, fleet.active_worker,
                     fleet.active_size, fleet.active_c_hat, None, np.asarray(p_fin, float),
                     np.full(4, 2.0))


def test_turnover_gamma_hand_worked():
    # G = 2, H = 10: two of four requests end within the window, at 3 and 5: the second
    # completion, one per worker, comes at 5 steps -> effective horizon 5, gamma 0.8
    fleet = turnover_fleet([3, 10, 10, 5])
    assert turnover_gamma(fleet, 10) == pytest.approx(0.8)
    assert turnover_gamma(fleet, 10, scale=0.5) == pytest.approx(0.6)  # 2.5 steps
    # exactly G ending at once: tau is that step, not G H / n(H) = H
    assert turnover_gamma(turnover_fleet([1, 1, 10, 10]), 10) == 0.0
    assert turnover_gamma(turnover_fleet([1, 2, 10, 10]), 10) == pytest.approx(0.5)
    # one ending within H (fewer than G): the rate over the window carried on, 2 * 10 / 1
    assert turnover_gamma(turnover_fleet([4, 10, 10, 10]), 10) == pytest.approx(0.9)
    # with p_fin the expected count of endings is its sum (here 0.5 + 0.5 + 0 + 0 = 1):
    # 20 steps, capped at H = 10
    assert turnover_gamma(turnover_fleet([3, 10, 10, 5], [0.5, 0.5, 0, 0]), 10,
                          scale=0.25) == pytest.approx(0.8)
    # nothing ends: capped at H; everything ends fast: floored at 1 step (gamma 0)
    assert turnover_gamma(turnover_fleet([10, 10, 10, 10]), 10) == pytest.approx(0.9)
    assert turnover_gamma(turnover_fleet([1, 1, 1, 1]), 80, scale=0.01) == 0.0
    # more than G end within H: the time by which G = 2 are expected to have ended. Ends at
    # 1, 2, 3, 4: n(1) = 1, n(2) = 2, so 2 steps -> gamma 0.5 (G H / n(H) = 2 * 10 / 4 = 5
    # steps, gamma 0.8, would count each slot once though it turns over within the window)
    assert turnover_gamma(turnover_fleet([1, 2, 3, 4]), 10) == pytest.approx(0.5)
    # ... between two steps, linearly: ends at 1, 3, 3, 9: n(1) = 1, n(2) = 1, n(3) = 3,
    # so n = 2 at 2.5 steps -> gamma 0.6
    assert turnover_gamma(turnover_fleet([1, 3, 3, 9]), 10) == pytest.approx(0.6)
    # under the predictor's law, with the uniform end-time law (the option kept): each ends
    # surely (p_fin 1), uniformly over [0, 4] (mu_rem 2), so n(t) = 4 t / 4 = t and n = 2 at
    # t = 2 -> gamma 0.5
    law = turnover_fleet([2, 2, 2, 2], [1, 1, 1, 1])
    assert turnover_gamma(law, 10, end_shape="uniform") == pytest.approx(0.5)
    # with the default (a constant hazard truncated to the window, mean mu_rem 2 at H = 10):
    # the rate x solves 1/x - 1/(e^x - 1) = 0.2 (x = 4.80), P(T <= t) = (1 - e^{-x t / H}) /
    # (1 - e^{-x}): n(1) = 4 * 0.3844 = 1.538, n(2) = 4 * 0.6222 = 2.489, so n = 2 at
    # 1 + 0.462 / 0.951 = 1.486 steps -> gamma 0.327
    x = brentq(lambda x: 1 / x - 1 / np.expm1(x) - 0.2, 0.1, 50)
    n1, n2 = (4 * -np.expm1(-x * t / 10) / -np.expm1(-x) for t in (1, 2))
    steps = 1 + (2 - n1) / (n2 - n1)
    assert turnover_gamma(law, 10) == pytest.approx(1 - 1 / steps)
    assert turnover_gamma(law, 10) == pytest.approx(0.327, abs=1e-3)
    # mu_rem above H / 2: the end time is uniform on [2 mu - H, H]; mu_rem 8 at H = 10: on
    # [6, 10], so n(t) = 4 (t - 6) / 4 = t - 6 and n = 2 at t = 8 -> gamma 0.875
    late = FleetView(law.capacity, law.loads, law.active_counts, law.active_worker,
                     law.active_size, law.active_c_hat, None, np.ones(4), np.full(4, 8.0))
    assert turnover_gamma(late, 10, end_shape="uniform") == pytest.approx(0.875)
    # p_fin without mu_rem: the endings spread evenly over the window, n(t) = sum(p) t / H =
    # 4 t / 10, so n = 2 at t = 5 -> gamma 0.8
    flat = FleetView(law.capacity, law.loads, law.active_counts, law.active_worker,
                     law.active_size, law.active_c_hat, None, np.ones(4), None)
    assert turnover_gamma(flat, 10) == pytest.approx(0.8)


def test_turnover_gamma_of_a_fleet_filling_up():
    """G = 2, H = 10, capacity 8 per worker, four active requests, none ending within the
    window: by completions alone the next admission is past H (gamma 0.9). With arrivals
    measured at lambda per step and free slots left after the round, admissions come as
    fast as arrivals fill them: min(F + n(t), P + lambda t)."""
    fleet = turnover_fleet([10, 10, 10, 10])  # 12 free slots
    assert turnover_gamma(fleet, 10, pool=1) == pytest.approx(0.9)  # no rate measured
    # lambda 0.5: one waiting now (admitted this round, 11 slots left), then 0.5 t, so two
    # admissions (one per worker) by t = 4 -> gamma 0.75
    filling = replace(fleet, arrival_rate=0.5)
    assert turnover_gamma(filling, 10, pool=1) == pytest.approx(0.75)
    # lambda 4: two by t = 0.5, floored at 1 step -> gamma 0 (routed as BR-0)
    assert turnover_gamma(replace(fleet, arrival_rate=4.0), 10, pool=1) == 0.0
    # no pool given: completions alone, as before
    assert turnover_gamma(filling, 10) == pytest.approx(0.9)
    # saturated (the pool fills every free slot): admissions wait on completions, whatever
    # the arrivals
    assert turnover_gamma(replace(fleet, arrival_rate=4.0), 10, pool=20) == pytest.approx(0.9)
    # never a longer lookahead than completions give: ends at 1, 2, 3, 4 (G = 2 ended by
    # t = 2, gamma 0.5) with arrivals at 0.1 per step
    ending = replace(turnover_fleet([1, 2, 3, 4]), arrival_rate=0.1)
    assert turnover_gamma(ending, 10, pool=1) == pytest.approx(0.5)


def assert_zero_gamma_round_is_br0s(fleet: FleetView, pool: list, brh: list) -> None:
    """A default BR-H round at gamma 0 is exactly default BR-0's (its guard and Stage 2
    too); set explicitly, BR-H's own rules are kept; ``zero_gamma_rules="brh"`` keeps BR-H's
    guard (``idle``) and Stage 2 (the paper's), the rule before 2026-12-05."""
    assert brh == route_round(fleet, pool, BalanceRouteParams.br0())[0]
    assert route_round(fleet, pool, BalanceRouteParams(guard="idle"))[0] == route_round(
        fleet, pool, BalanceRouteParams.br0(guard="idle"))[0]
    assert route_round(fleet, pool, BalanceRouteParams(zero_gamma_rules="brh"))[0] == (
        route_round(fleet, pool, BalanceRouteParams.br0(
            guard="idle", stage2_order="slots", stage2_fill=False))[0])
    always, _ = route_round(fleet, pool, BalanceRouteParams(guard="always",
                                                            zero_gamma_rules="brh"))
    assert always == route_round(fleet, pool, BalanceRouteParams.br0(
        stage2_order="slots", stage2_fill=False))[0]


def test_a_filling_fleet_is_routed_as_br0_where_arrivals_come_every_step():
    """BR-H's round reads the arrival rate only under ``turnover_arrivals`` (default)."""
    rng = np.random.default_rng(12)
    fleet = replace(turnover_fleet([10, 10, 10, 10]), arrival_rate=8.0)
    for _ in range(20):
        pool = random_pool(rng, int(rng.integers(1, 8)))
        brh, stats = route_round(fleet, pool, BalanceRouteParams(horizon=10))
        assert stats.extra["gamma"] == 0.0
        assert_zero_gamma_round_is_br0s(fleet, pool, brh)
        _, before = route_round(fleet, pool, BalanceRouteParams(horizon=10,
                                                                turnover_arrivals=False))
        assert before.extra["gamma"] == pytest.approx(0.9)


def test_arrival_rate_is_the_mean_of_the_steps_seen_weighted_toward_recent():
    rate = ArrivalRate(memory=2.0)  # decay 0.5
    assert rate.rate is None
    rate.add(4)
    assert rate.rate == 4.0  # one step seen: its count, not biased toward 0
    rate.add(0)
    assert rate.rate == pytest.approx((0.5 * 4 + 0) / (0.5 + 1))
    rate.add(0, steps=3)  # an idle stretch: three steps with none
    weight = 0.5 ** 3 * 1.5 + (1 + 0.5 + 0.25)
    assert rate.rate == pytest.approx(0.5 ** 3 * 2.0 / weight)
    with pytest.raises(ValueError):
        ArrivalRate(memory=0.5)


def test_a_round_with_gamma_0_is_routed_as_br0():
    """Where the next admission to a worker comes within a step (gamma 0), BR-H routes the
    round exactly as BR-0 (Stage-1 rule, guard and Stage 2 included: a short pool goes
    largest first), and reports gamma 0; with the paper's beta (not alpha G) it keeps its
    own score."""
    rng = np.random.default_rng(11)
    for _ in range(30):
        fleet = random_fleet(rng, 4, 8)
        # every active request ends next step: n(1) = all >= G, so tau <= 1 step
        fleet = FleetView(fleet.capacity, fleet.loads, fleet.active_counts, fleet.active_worker,
                          fleet.active_size, np.ones(fleet.active_size.shape[0]))
        pool = random_pool(rng, int(rng.integers(1, 12)))  # short pools and saturated ones
        brh, stats = route_round(fleet, pool, BalanceRouteParams())
        assert stats.extra["gamma"] == 0.0
        assert_zero_gamma_round_is_br0s(fleet, pool, brh)
        paper, paper_stats = route_round(fleet, pool, BalanceRouteParams.paper(gamma=None))
        assert paper_stats.extra["gamma"] == 0.0


def test_a_round_of_a_one_step_horizon_is_routed_as_br0():
    """An effective horizon ``1 / (1 - gamma)`` below ``myopic_horizon`` (1.5 steps) rounds
    to one step: the round is BR-0's, as at gamma 0, and reports its discount. G = 2, ends at
    1, 2, 2, 2: n(1) = 1, n(2) = 4, so the second completion comes at 1 + 1/3 steps (gamma
    0.25). ``myopic_horizon=1`` keeps BR-H's rules there (the rule before), which route some
    of these rounds otherwise; at 2.5 steps (ends 1, 3, 3, 9) the round stays BR-H's."""
    rng = np.random.default_rng(13)
    fleet = turnover_fleet([1, 2, 2, 2])
    assert turnover_gamma(fleet, 80) == pytest.approx(0.25)
    differ = 0
    for _ in range(30):
        pool = random_pool(rng, int(rng.integers(1, 30)))
        brh, stats = route_round(fleet, pool, BalanceRouteParams())
        assert stats.extra["gamma"] == pytest.approx(0.25) and stats.extra["as_br0"]
        assert_zero_gamma_round_is_br0s(fleet, pool, brh)
        before, before_stats = route_round(fleet, pool, BalanceRouteParams(myopic_horizon=1.0))
        assert "as_br0" not in before_stats.extra
        assert before_stats.extra["gamma"] == pytest.approx(0.25)
        differ += before != brh
        _, longer = route_round(turnover_fleet([1, 3, 3, 9]), pool, BalanceRouteParams())
        assert "as_br0" not in longer.extra and longer.extra["gamma"] == pytest.approx(0.6)
        # the paper's beta keeps its own score, as at gamma 0
        _, paper = route_round(fleet, pool, BalanceRouteParams.paper(gamma=None))
        assert "as_br0" not in paper.extra
    assert differ > 0


def test_a_long_view_waits_on_its_own_f():
    """``own_wait_horizon``: in a round whose effective horizon reaches that many steps, the
    guard ``idle`` leaves a worker's slots empty wherever BR-H's own F of every subset is
    <= 0, even where BR-0's view now says an overflow pays. So such a round admits no more
    than the default's, and where the two differ it held a worker back; a worker with no
    request never waits; the guard ``always`` and a horizon never reached change nothing."""
    rng = np.random.default_rng(17)
    differ = 0
    for _ in range(200):
        fleet = random_fleet(rng, int(rng.integers(2, 6)), int(rng.integers(2, 8)))
        pool = random_pool(rng, int(rng.integers(1, 40)))
        default, _ = route_round(fleet, pool, BalanceRouteParams(own_wait_horizon=None))
        own, stats = route_round(fleet, pool, BalanceRouteParams(own_wait_horizon=1.0))
        assert len(own) <= len(default)
        if own != default:
            differ += 1
            assert stats.waited
        empty = ({g for g in range(fleet.workers) if fleet.free_slots[g] == fleet.capacity}
                 - {a.worker for a in own})  # empty still when Stage 2 comes to it
        assert not empty & set(stats.waited)
        never, _ = route_round(fleet, pool, BalanceRouteParams(own_wait_horizon=1e6))
        assert never == default
        assert route_round(fleet, pool, BalanceRouteParams(guard="always",
                                                           own_wait_horizon=1.0))[0] == \
            route_round(fleet, pool, BalanceRouteParams(guard="always",
                                                        own_wait_horizon=None))[0]
    assert differ > 0


def test_a_long_view_waits_on_its_own_f_with_known_loads_only():
    """With a learned law (``p_fin``, ``mu_rem``) the own wait does not act: the round is the
    one without it (``own_wait_horizon=None``), unless ``own_wait_learned``, which waits as
    with known loads (so the law's rounds do differ, and the default leaves them)."""
    rng = np.random.default_rng(19)
    differ = 0
    for _ in range(200):
        fleet = random_fleet(rng, int(rng.integers(2, 6)), int(rng.integers(2, 8)))
        n = fleet.active_size.size
        learned = replace(fleet, active_p_fin=rng.uniform(0, 1, n),
                          active_mu_rem=rng.uniform(0, 80, n))
        pool = random_pool(rng, int(rng.integers(1, 40)))
        never = route_round(learned, pool, BalanceRouteParams(own_wait_horizon=None))[0]
        assert route_round(learned, pool, BalanceRouteParams(own_wait_horizon=1.0))[0] == never
        waits, stats = route_round(learned, pool, BalanceRouteParams(own_wait_horizon=1.0,
                                                                     own_wait_learned=True))
        if waits != never:
            differ += 1
            assert stats.waited and len(waits) <= len(never)
    assert differ > 0


def _round_measure(fleet, pool, params, gamma, admitted):
    """BR-H's own measure of a round, from its definition rather than the router's sums:
    alpha times the discounted work the admissions add, less beta times the discounted rise
    of the envelope (the fleet's highest projected load at each step) that they cause."""
    table = build_table(fleet, params, None, gamma)
    loads, d = table.loads.copy(), table.d
    rows = candidate_rows(np.array([float(r.prompt_tokens) for r in pool]), None,
                          params.horizon)
    before = loads.max(axis=0)
    added = np.zeros_like(d)
    for a in admitted:
        loads[a.worker] += rows[a.pool_index]
        added += rows[a.pool_index]
    beta = params.effective_beta(fleet.workers)
    return params.alpha * float(added @ d) - beta * float((loads.max(axis=0) - before) @ d)


def test_a_round_checked_against_br0s():
    """``br0_check``: BR-H's round stands only where its own measure is above that of BR-0's
    round from the same state by more than ``br0_check`` candidates' discounted fill (the
    mean over the first ``r_max`` candidates of ``alpha`` times a row's discounted work);
    otherwise the round is BR-0's. The measure and the scale here are computed from their
    definitions (work added less beta times the envelope's rise, discounted), independently
    of the router's summed F; both outcomes occur, a threshold on either side of a round's
    own gain decides it, a huge one always gives BR-0's round, and None changes nothing."""
    rng = np.random.default_rng(23)
    kept = replaced = 0
    for _ in range(150):
        fleet = random_fleet(rng, int(rng.integers(2, 6)), int(rng.integers(2, 8)))
        pool = random_pool(rng, int(rng.integers(1, 40)))
        params = BalanceRouteParams(own_wait_horizon=None)
        own, stats = route_round(fleet, pool, params)
        br0, _ = route_round(fleet, pool, BalanceRouteParams.br0())
        checked, checked_stats = route_round(fleet, pool, replace(params, br0_check=0.0))
        huge, _ = route_round(fleet, pool, replace(params, br0_check=1e12))
        same = ({(a.pool_index, a.worker) for a in own}
                == {(a.pool_index, a.worker) for a in br0})
        if stats.extra.get("as_br0") or same:
            assert checked == own and huge == own
            continue
        gamma = stats.extra["gamma"]
        gain = (_round_measure(fleet, pool, params, gamma, own)
                - _round_measure(fleet, pool, params, gamma, br0))
        scale = abs(_round_measure(fleet, pool, params, gamma, own)) + 1.0
        assert huge == br0
        if abs(gain) < 1e-9 * scale:
            continue  # a tie to rounding: either is right
        table = build_table(fleet, params, None, gamma)
        rows = candidate_rows(np.array([float(r.prompt_tokens) for r in pool]), None,
                              params.horizon)[: params.effective_r_max(fleet.workers)]
        candidates = gain / (params.alpha * float((rows @ table.d).mean()))
        if candidates > 1e-6:  # a threshold on either side of the gain decides it
            below, _ = route_round(fleet, pool, replace(params, br0_check=0.5 * candidates))
            above, _ = route_round(fleet, pool, replace(params, br0_check=2.0 * candidates))
            assert below == own and above == br0
        if gain > 0:
            assert checked == own
            assert not checked_stats.extra.get("br0_check")
            assert checked_stats.extra["br0_check_gain"] == pytest.approx(candidates)
            kept += 1
        else:
            assert checked == br0
            assert checked_stats.extra["br0_check"] and checked_stats.used_prediction
            replaced += 1
    assert kept > 0 and replaced > 0


def test_turnover_discount_is_used_and_reported():
    rng = np.random.default_rng(5)
    fleet, pool = random_fleet(rng, 4, 8), random_pool(rng, 20)
    params = BalanceRouteParams(gamma=None, turnover_scale=1.5)
    _, stats = route_round(fleet, pool, params)
    assert stats.extra["gamma"] == pytest.approx(turnover_gamma(fleet, 80, 1.5))
    fixed = route_round(fleet, pool, BalanceRouteParams(gamma=stats.extra["gamma"]))
    assert fixed[0] == route_round(fleet, pool, params)[0]


@pytest.mark.parametrize("field, value", [("gamma", 0.0), ("gamma", 1.5), ("r_max", 0),
                                          ("turnover_scale", 0.0),
                                          ("horizon", -1), ("stage1", "nope"), ("alpha", 0.0),
                                          ("guard", "never"), ("zero_gamma_rules", "x"),
                                          ("myopic_horizon", 0.5),
                                          ("own_wait_horizon", 0.5),
                                          ("br0_check", -0.1), ("beta", float("nan")),
                                          ("beta", float("inf")), ("alpha", float("nan")),
                                          ("alpha", float("inf"))])
def test_params_validation_names_the_field(field, value):
    with pytest.raises(ParameterError, match=field):
        BalanceRouteParams(**{field: value})


def test_brh_falls_back_to_br0_without_predictions():
    rng = np.random.default_rng(3)
    fleet = random_fleet(rng, 4, 8)
    without = FleetView(fleet.capacity, fleet.loads, fleet.active_counts, fleet.active_worker,
                        fleet.active_size, None)
    pool = random_pool(rng, 12)
    brh = BalanceRoutePolicy("brh-x", BalanceRouteParams())
    br0 = BalanceRoutePolicy("br0", BalanceRouteParams.br0())
    assert brh.route(without, pool).assignments == br0.route(without, pool).assignments
    assert not brh.route(without, pool).stats.used_prediction


def test_paper_stage1_picks_worker_with_most_free_slots_then_best_F():
    # worker 0: 1 free slot, load 0; worker 1: 3 free slots, load 900 -> paper picks worker 1
    fleet = FleetView.from_active(2, 3, np.array([0, 0, 1]), np.array([0.0, 0.0, 900.0]))
    fleet = FleetView(3, np.array([0.0, 900.0]), np.array([2, 0]), fleet.active_worker,
                      fleet.active_size)
    pool = [WaitingRequest("a", 100), WaitingRequest("b", 50), WaitingRequest("c", 70)]
    params = BalanceRouteParams.br0(stage1="paper", s_greedy=0)
    got, stats = route_round(fleet, pool, params)
    # worker 1 has margin 0: every request overflows; the smallest overflow (50) scores best
    assert got[0].worker == 1 and got[0].pool_index == 1
    assert stats.stage1_admissions == len(got)


def test_auto_stage1_places_like_least_load_when_the_pool_is_short():
    fleet = FleetView(4, np.array([3000.0, 100.0, 2000.0]), np.array([1, 1, 0]),
                      np.array([0, 1]), np.array([3000.0, 100.0]))
    pool = [WaitingRequest("a", 500)]
    got, _ = route_round(fleet, pool, BalanceRouteParams.br0())
    assert got[0].worker == 1  # the least loaded worker, not the one with most free slots
    got, _ = route_round(fleet, pool, BalanceRouteParams.br0(stage1="paper"))
    assert got[0].worker == 2  # paper rule: most free slots


def test_lpt_places_a_short_pool_largest_first_where_best_pair_places_it_last():
    # G = 3, B = 4; loads 500, 500, 0 (envelope 500, margins 0, 0, 500); pool a = 350, b = 600
    fleet = FleetView(4, np.array([500.0, 500.0, 0.0]), np.array([1, 1, 0]),
                      np.array([0, 1]), np.array([500.0, 500.0]))
    pool = [WaitingRequest("a", 350), WaitingRequest("b", 600)]
    # best-pair: worker 2 scores a at F = 350 (fits) and b at 600 - 3 * 100 = 300, so a goes
    # first; then b overflows everywhere and lands on worker 2 too: loads 500, 500, 950
    got, _ = route_round(fleet, pool, BalanceRouteParams.br0(stage1="auto-pair"))
    assert [(a.pool_index, a.worker) for a in got] == [(0, 2), (1, 2)]
    # lpt: b (the largest) onto worker 2 (load 0), then a onto the least loaded of 500, 500,
    # 600 (worker 0, the lower index): loads 850, 500, 600, envelope 850 instead of 950
    for rule in ("lpt", "auto"):
        got, stats = route_round(fleet, pool, BalanceRouteParams.br0(stage1=rule))
        assert [(a.pool_index, a.worker) for a in got] == [(1, 2), (0, 0)]
        assert stats.stage1_admissions == 2 and stats.stage2_admissions == 0


def test_brh_places_a_short_pool_largest_first_by_default_and_best_pair_on_request():
    """The BR-0 example above with true lengths: both active requests run through the window
    (c_hat = H), so the loads are 500 + h, 500 + h, 0 and the margins 0, 0, 500 + h; the
    pool a = 350, b = 600 grows by one token a step (candidate rows). ``best-pair`` (the rule
    before 2026-12-01) takes a first (it fits worker 2 at every step, F = sum d (350 + h),
    against b's sum d (600 + h) - 3 sum d 100), then b overflows every worker and lands on
    worker 2 too. The default ``lpt-fit`` (and ``lpt``) takes b first onto worker 2 (it fits
    nowhere now; worker 2 is the only worker it does not overflow by its whole size), then a
    overflows workers 0 and 1 by 250 and worker 2 by its whole size: worker 0 (equal F and
    load with worker 1, the lower index)."""
    fleet = FleetView(4, np.array([500.0, 500.0, 0.0]), np.array([1, 1, 0]),
                      np.array([0, 1]), np.array([500.0, 500.0]),
                      active_c_hat=np.array([10.0, 10.0]))
    pool = [WaitingRequest("a", 350), WaitingRequest("b", 600)]
    params = BalanceRouteParams(horizon=10, gamma=0.9)
    for reference in (None, True):
        got, stats = route_round(fleet, pool, params, reference=reference)
        assert [(a.pool_index, a.worker) for a in got] == [(1, 2), (0, 0)]
        assert stats.stage1_admissions == 2 and stats.stage2_admissions == 0
        got, _ = route_round(fleet, pool, replace(params, short_pool="best-pair"),
                             reference=reference)
        assert [(a.pool_index, a.worker) for a in got] == [(0, 2), (1, 2)]
        got, _ = route_round(fleet, pool, replace(params, stage1="auto-pair"),
                             reference=reference)
        assert [(a.pool_index, a.worker) for a in got] == [(0, 2), (1, 2)]
    with pytest.raises(ParameterError, match="short_pool"):
        BalanceRouteParams(short_pool="largest")  # type: ignore[arg-type]


def test_lpt_load_places_a_short_pool_as_br0_even_where_the_lookahead_disagrees():
    """Worker 0's request ends after this step (c_hat 1): BR-H's F sees it empty from step 1
    and places the request there (``lpt``, the default); ``lpt-load`` places it as BR-0 does,
    onto the least loaded now (worker 1)."""
    fleet = FleetView(4, np.array([500.0, 400.0, 450.0]), np.array([1, 1, 1]),
                      np.array([0, 1, 2]), np.array([500.0, 400.0, 450.0]),
                      active_c_hat=np.array([1.0, 10.0, 10.0]))
    pool = [WaitingRequest("a", 300)]
    params = BalanceRouteParams(horizon=10, gamma=0.9)
    assert [a.worker for a in route_round(fleet, pool, params)[0]] == [0]
    assert [a.worker for a in route_round(
        fleet, pool, replace(params, short_pool="lpt-load"))[0]] == [1]
    assert [a.worker for a in route_round(fleet, pool, BalanceRouteParams.br0())[0]] == [1]


def test_lpt_fit_lets_the_lookahead_move_only_a_request_that_overflows_now():
    """Loads 500, 400, 450, one request each; worker 0's ends after this step (c_hat 1), the
    others run through the window (the example above). ``lpt-fit`` takes the least-loaded
    open worker (worker 1, margin 100 now) for a request that fits there now, and the best F
    for one that does not. A = 80 fits worker 1 now but overflows it from step 1 (the
    envelope falls to 450 + h when worker 0 empties: margin 50): ``lpt`` (best F) moves it
    to worker 0, ``lpt-fit`` keeps it on worker 1. A = 300 overflows worker 1 now: both take
    worker 0, where it overflows only at step 0."""
    fleet = FleetView(4, np.array([500.0, 400.0, 450.0]), np.array([1, 1, 1]),
                      np.array([0, 1, 2]), np.array([500.0, 400.0, 450.0]),
                      active_c_hat=np.array([1.0, 10.0, 10.0]))
    params = BalanceRouteParams(horizon=10, gamma=0.9)
    fit = replace(params, short_pool="lpt-fit")
    small, large = [WaitingRequest("a", 80)], [WaitingRequest("a", 300)]
    for reference in (None, True):
        assert [a.worker for a in route_round(fleet, small, replace(params, short_pool="lpt"),
                                              reference=reference)[0]] == [0]
        assert [a.worker for a in route_round(fleet, small, fit, reference=reference)[0]] == [1]
        assert [a.worker for a in route_round(fleet, small, params,  # the default
                                              reference=reference)[0]] == [1]
        exact = [WaitingRequest("a", 100)]  # exactly worker 1's margin now: it fits
        assert [a.worker for a in route_round(fleet, exact, fit, reference=reference)[0]] == [1]
        assert [a.worker for a in route_round(fleet, exact, replace(params, short_pool="lpt"),
                                              reference=reference)[0]] == [0]
        assert [a.worker for a in route_round(fleet, large, fit, reference=reference)[0]] == [0]
        assert [a.worker for a in route_round(fleet, large, replace(params, short_pool="lpt"),
                                              reference=reference)[0]] == [0]


def test_fit_horizon_lets_lpt_fit_place_by_f_where_the_round_looks_far_enough():
    """The fleet above at gamma 0.9: an effective horizon 1 / (1 - gamma) of 10 steps. With
    ``fit_horizon`` 9.5 the round looks far enough and ``lpt-fit`` places by F as ``lpt``
    does (A = 80 onto worker 0); with 10.5, or unset, it keeps BR-0's worker 1."""
    fleet = FleetView(4, np.array([500.0, 400.0, 450.0]), np.array([1, 1, 1]),
                      np.array([0, 1, 2]), np.array([500.0, 400.0, 450.0]),
                      active_c_hat=np.array([1.0, 10.0, 10.0]))
    small = [WaitingRequest("a", 80)]
    for limit, want in ((9.5, 0), (10.5, 1), (None, 1)):
        params = BalanceRouteParams(horizon=10, gamma=0.9, fit_horizon=limit)
        for reference in (None, True):
            assert [a.worker for a in route_round(fleet, small, params,
                                                  reference=reference)[0]] == [want]
    # exactly at the limit counts (gamma 0.95 is a horizon of 20 steps, to rounding)
    params = BalanceRouteParams(horizon=10, gamma=0.95, fit_horizon=20)
    assert [a.worker for a in route_round(fleet, small, params)[0]] == [0]
    # the round's own gamma, from the turnover: worker 0's request ends after this step and
    # the others run through the window, one completion expected within 10 steps among
    # G = 4 workers: the next admission to a worker about 40 steps away, past the window,
    # so the effective horizon is H = 10 (gamma 0.9) and a limit of 10 is reached
    turnover = BalanceRouteParams(horizon=10, fit_horizon=10)
    assert [a.worker for a in route_round(fleet, small, turnover)[0]] == [0]
    assert [a.worker for a in route_round(fleet, small, replace(turnover, fit_horizon=11))[0]
            ] == [1]
    # gamma 1 (no discount): an unbounded horizon reaches any limit
    flat = BalanceRouteParams(horizon=10, gamma=1.0, fit_horizon=1000)
    assert [a.worker for a in route_round(fleet, small, flat)[0]] == [0]
    with pytest.raises(ParameterError, match="fit_horizon"):
        BalanceRouteParams(fit_horizon=0.5)


def test_lpt_count_weight_prefers_the_worker_with_fewer_active_requests():
    # loads 500, 500, 0 with 3, 1 and 0 active requests; weight 10: keys 530, 510, 0
    fleet = FleetView(4, np.array([500.0, 500.0, 0.0]), np.array([3, 1, 0]),
                      np.array([0, 0, 0, 1]), np.array([200.0, 200.0, 100.0, 500.0]))
    pool = [WaitingRequest("a", 350), WaitingRequest("b", 600)]
    params = BalanceRouteParams.br0(stage1="lpt", lpt_count_weight=10.0)
    got, _ = route_round(fleet, pool, params)
    assert [(a.pool_index, a.worker) for a in got] == [(1, 2), (0, 1)]
    got, _ = route_round(fleet, pool, params, reference=True)
    assert [(a.pool_index, a.worker) for a in got] == [(1, 2), (0, 1)]


def test_brh_lpt_places_the_largest_where_its_lookahead_scores_best():
    """``stage1="lpt"`` with BR-H, and ``auto`` (its default ``short_pool="lpt-fit"``, where
    the request of 300 does not fit the least-loaded worker now) alike."""
    # Loads 500, 400, 450, one request each; worker 0's ends after this step (c_hat 1), the
    # others run through the window. A request of 300 (short pool): BR-0's lpt takes the least
    # loaded now (worker 1); BR-H's F sees worker 0 empty from step 1 on (margin 450 + h
    # against 50 on worker 1: it overflows only at step 0 there) and takes worker 0.
    fleet = FleetView(4, np.array([500.0, 400.0, 450.0]), np.array([1, 1, 1]),
                      np.array([0, 1, 2]), np.array([500.0, 400.0, 450.0]),
                      active_c_hat=np.array([1.0, 10.0, 10.0]))
    pool = [WaitingRequest("a", 300)]
    got, _ = route_round(fleet, pool, BalanceRouteParams.br0())
    assert [(a.pool_index, a.worker) for a in got] == [(0, 1)]
    got, stats = route_round(fleet, pool, BalanceRouteParams(horizon=10, gamma=0.9,
                                                             stage1="lpt"))
    assert [(a.pool_index, a.worker) for a in got] == [(0, 0)]
    assert stats.stage1_admissions == 1
    got, _ = route_round(fleet, pool, BalanceRouteParams(horizon=10, gamma=0.9))
    assert [(a.pool_index, a.worker) for a in got] == [(0, 0)]


def test_lpt_applies_only_to_a_short_pool():
    # 2 free slots in all, 3 waiting: not short, so lpt is the paper's rule (most free slots)
    fleet = FleetView(2, np.array([900.0, 100.0]), np.array([1, 1]), np.array([0, 1]),
                      np.array([900.0, 100.0]))
    pool = [WaitingRequest(i, s) for i, s in enumerate([50, 700, 60])]
    params = BalanceRouteParams.br0(stage1="lpt", s_greedy=0)
    assert route_round(fleet, pool, params)[0] == route_round(
        fleet, pool, BalanceRouteParams.br0(stage1="paper", s_greedy=0))[0]


def test_stage2_and_starvation_guard():
    # every worker is at the envelope (margin 0): F < 0 for any request, the guard admits one
    fleet = FleetView(2, np.array([1000.0, 1000.0]), np.array([1, 1]), np.array([0, 1]),
                      np.array([1000.0, 1000.0]))
    pool = [WaitingRequest("a", 300), WaitingRequest("b", 100), WaitingRequest("c", 200)]
    got, stats = route_round(fleet, pool, BalanceRouteParams.br0(s_greedy=7))
    assert stats.stage1_admissions == 0
    assert stats.starvation_guard_admissions == 2
    assert [a.pool_index for a in got] == [1, 2]  # smallest overflow first, then the next
    assert all(a.starvation_guard for a in got)


def many_small(per_worker_size, loads=(1000.0, 1000.0), capacity=11):
    """G = 2 workers of B = ``capacity``, each holding requests of ``per_worker_size``
    tokens up to its load (10 each at the defaults)."""
    counts = [int(load // per_worker_size) for load in loads]
    worker = np.repeat(np.arange(len(loads)), counts)
    size = np.concatenate([np.full(c, load / c) for c, load in zip(counts, loads, strict=True)])
    return FleetView.from_active(len(loads), capacity, worker, size)


def test_guard_idle_leaves_the_slots_empty_where_no_request_lowers_the_imbalance():
    # G = 2, B = 11, each worker 10 requests (1,000 tokens: N = 20, maximum M = 1,000,
    # margins 0: every request overflows by its whole size, F = s - 2 s < 0); 2 free slots,
    # not more than s_greedy 2 (Stage 1 does not run now), but 22 slots in the fleet, so
    # Stage 1 admits once enough slots are free. No fixed step cost
    # (step_overhead 0): the 100-token request would overflow by 100, and N o = 2,000 >= M:
    # it lowers this step's throughput too. "idle" leaves the free slots empty this round.
    fleet = many_small(100.0)
    pool = [WaitingRequest("a", 300), WaitingRequest("b", 100), WaitingRequest("c", 200)]
    always, stats = route_round(fleet, pool, BalanceRouteParams.br0(s_greedy=2))
    assert [a.pool_index for a in always] == [1, 2] and stats.starvation_guard_admissions == 2
    idle = BalanceRouteParams.br0(s_greedy=2, guard="idle", step_overhead=0.0)
    for reference in (True, False):
        got, stats = route_round(fleet, pool, idle, reference=reference)
        assert got == [] and stats.starvation_guard_admissions == 0
    # a request that fits under a margin is still admitted: worker 0 at 900 (margin 100)
    lower = many_small(90.0, loads=(900.0, 1000.0))
    got, _ = route_round(lower, pool, idle)
    assert [(a.pool_index, a.worker, a.starvation_guard) for a in got] == [(1, 0, False)]
    # where Stage 1 could never run (22 slots <= s_greedy 22) or G = 1, "idle" is "always"
    assert route_round(fleet, pool, replace(idle, s_greedy=22))[0] == \
        route_round(fleet, pool, BalanceRouteParams.br0(s_greedy=22))[0]
    single = many_small(100.0, loads=(1000.0,))
    got, stats = route_round(single, pool, replace(idle, s_greedy=1))
    assert len(got) == 1 and stats.starvation_guard_admissions == 1


@pytest.mark.parametrize("reference", [True, False])
def test_guard_idle_lets_a_few_requests_share_the_fixed_cost(reference):
    # G = 2, B = 2, one 1,000-token request on each worker (N = 2, margins 0; 2 free slots, 4
    # in the fleet). BR-0's F now says no (100 - 2 * 100 = -100): without a fixed step cost
    # (K = 0) "idle" waits, though this step's throughput would rise (3 / (1,100 a) > 2 /
    # (1,000 a): the README's "The rule's known limit"). The share 2 K
    # / 2 turns it at K = 100: with K = 101 worker 0 admits the 100-token request, worker 1
    # (margin 100, N = 3) the 200-token one (200 - 2 * 100 + 2 * 101 / 3 > 0); the default K
    # (66,667 tokens) admits as "always" does.
    fleet = FleetView.from_active(2, 2, np.array([0, 1]), np.array([1000.0, 1000.0]))
    pool = [WaitingRequest("a", 300), WaitingRequest("b", 100), WaitingRequest("c", 200)]
    idle = BalanceRouteParams.br0(s_greedy=2, guard="idle", step_overhead=0.0)
    assert route_round(fleet, pool, idle, reference=reference)[0] == []
    assert route_round(fleet, pool, replace(idle, step_overhead=99.0),
                       reference=reference)[0] == []
    got, _ = route_round(fleet, pool, replace(idle, step_overhead=101.0), reference=reference)
    assert [(a.pool_index, a.worker, a.starvation_guard) for a in got] == [(1, 0, True),
                                                                           (2, 1, True)]
    assert route_round(fleet, pool, replace(idle, step_overhead=None),
                       reference=reference)[0] == \
        route_round(fleet, pool, BalanceRouteParams.br0(s_greedy=2), reference=reference)[0]


@pytest.mark.parametrize("reference", [True, False])
def test_guard_idle_weighs_an_overflow_against_the_steps_fixed_cost(reference):
    # G = 2, B = 11, each worker 10 requests of 50 tokens (N = 20, M = 500). Worker 0 chooses
    # first (by index): the 100-token request scores F now = 100 - 2 * 100 = -100, plus its
    # share of the step's fixed cost K = b / a, 2 K / 20. With K = 900 tokens: -10, nothing is
    # admitted (nor on worker 1, alike). With 1,100: +10, admitted (the guard's pick); worker
    # 0 at 600 then leaves worker 1 a margin of 100 and N = 21: the 200-token request scores
    # 200 - 2 * 100 + 2 * 1,100 / 21 > 0, admitted too.
    fleet = many_small(50.0, loads=(500.0, 500.0))
    pool = [WaitingRequest("a", 300), WaitingRequest("b", 100), WaitingRequest("c", 200)]
    params = BalanceRouteParams.br0(s_greedy=2, guard="idle", step_overhead=900.0)
    assert route_round(fleet, pool, params, reference=reference)[0] == []
    params = replace(params, step_overhead=1100.0)
    got, stats = route_round(fleet, pool, params, reference=reference)
    assert [(a.pool_index, a.worker, a.starvation_guard) for a in got] == [(1, 0, True),
                                                                           (2, 1, True)]
    # a fleet view that knows its fixed cost (the simulator's) is read where the parameters
    # leave it unset; the parameters' value wins
    unset = replace(params, step_overhead=None)
    assert route_round(replace(fleet, step_overhead=1100.0), pool, unset,
                       reference=reference)[0] == got
    assert route_round(replace(fleet, step_overhead=1100.0), pool,
                       replace(params, step_overhead=0.0), reference=reference)[0] == []
    # the default (the simulator's default step cost, 66,667 tokens) admits where so few
    # requests share a step: the guard "always"'s choice
    assert route_round(fleet, pool, unset, reference=reference)[0] == \
        route_round(fleet, pool, BalanceRouteParams.br0(s_greedy=2), reference=reference)[0]
    assert DEFAULT_STEP_OVERHEAD == pytest.approx(DEFAULT_STEP_COST[1] / DEFAULT_STEP_COST[0])


def test_guard_idle_lets_brh_admit_where_only_its_lookahead_objects():
    # G = 2, B = 2: worker 0 full at 100 (two requests ending after this step), worker 1 at
    # 60 with one free slot (margin 40). A 30-token request fits now (BR-0's F = 30 > 0), but
    # from step 1 worker 1 is the maximum and the request overflows for 79 steps: BR-H's F <
    # 0. The guard "idle" keeps a slot empty only where BR-0 would: BR-H admits it as under
    # "always". Against 50 tokens (F = 50 - 2 * 10 = 30 > 0 now) likewise; against 90 (F =
    # 90 - 2 * 50 < 0 now) the slot stays empty.
    worker = np.array([0, 0, 1])
    size = np.array([50.0, 50.0, 60.0])
    fleet = FleetView.from_active(2, 2, worker, size, np.array([1.0, 1.0, 80.0]))
    for prompt, admitted in ((30, True), (50, True), (90, False)):
        pool = [WaitingRequest(0, prompt), WaitingRequest(1, prompt)]
        view = replace(fleet, pool_c_hat=np.full(len(pool), 80.0))
        params = BalanceRouteParams(gamma=0.9, s_greedy=1, guard="always",
                                    step_overhead=0.0)  # no fixed step cost here
        always, stats = route_round(view, pool, params)
        assert [(a.pool_index, a.worker) for a in always] == [(0, 1)]
        assert stats.starvation_guard_admissions == 1  # BR-H's F <= 0 in every case
        idle, _ = route_round(view, pool, replace(params, guard="idle"))
        assert idle == (always if admitted else [])
        assert route_round(view, pool, replace(params, guard=None))[0] == idle  # the default


def test_guard_idle_never_holds_back_a_worker_with_no_request():
    # G = 2, B = 4: worker 0 holds one request (1,000 tokens, 5,000 steps left), worker 1
    # none. Every waiting request (5,000 tokens) overflows either margin by more than it
    # fills: "idle" would wait, but worker 1 holds nothing and nothing else would fill it
    fleet = FleetView.from_active(2, 4, np.array([0]), np.array([1000.0]), np.array([5000.0]))
    pool = [WaitingRequest(i, 5000) for i in range(8)]
    view = replace(fleet, pool_c_hat=np.full(len(pool), 200.0))
    for reference in (True, False):
        got, stats = route_round(view, pool, BalanceRouteParams(), reference=reference)
        assert 1 in {a.worker for a in got} and stats.starvation_guard_admissions >= 1
        got, _ = route_round(fleet, pool, BalanceRouteParams.br0(guard="idle"),
                             reference=reference)
        assert 1 in {a.worker for a in got}
    # a rank the proxy masks as down (shown full) leaves an idle rank 0: it takes a request
    # though the fleet's free slots (4) never exceed s_greedy (7), so Stage 1 never runs
    idle = FleetView.from_active(2, 4, np.array([], dtype=int), np.array([]), np.array([]))
    pool = [WaitingRequest(i, 500) for i in range(5)]
    view = replace(idle, pool_c_hat=np.full(len(pool), 40.0))
    for params in (BalanceRouteParams(), BalanceRouteParams.br0(guard="idle")):
        masked = RankMaskPolicy(make_policy("brh" if params.horizon else "br0", params=params),
                                [True, False])
        assert [(a.pool_index, a.worker) for a in masked.route(view, pool).assignments] == \
            [(0, 0)]
    # with rank 1 down, rank 0 (three 400-token requests, one free slot) is the fleet: there
    # is no imbalance to protect, so the guard admits as "always" though every request
    # overflows by 2,000 (N o = 6,000 >= M): the down rank, shown full, counts neither in G
    # nor in N
    one = FleetView.from_active(2, 4, np.zeros(3, dtype=int), np.full(3, 400.0),
                                np.full(3, 500.0))
    pool = [WaitingRequest(i, 2000) for i in range(5)]
    view = replace(one, pool_c_hat=np.full(len(pool), 40.0))
    for params in (BalanceRouteParams(step_overhead=0.0),
                   BalanceRouteParams.br0(guard="idle", step_overhead=0.0)):
        masked = RankMaskPolicy(make_policy("brh" if params.horizon else "br0", params=params),
                                [True, False])
        got = masked.route(view, pool).assignments
        assert [a.worker for a in got] == [0] and got[0].starvation_guard


@pytest.mark.parametrize("reference", [True, False])
def test_a_worker_out_of_patience_takes_its_best_request(reference):
    # the fleet of test_guard_idle_leaves_the_slots_empty_where_no_request_lowers_the_imbalance
    # (G = 2, B = 11, both workers at 1,000 tokens, margins 0, no fixed step cost): "idle"
    # holds both back. With a patience of 3 rounds, a worker that has waited 2 rounds in a
    # row still waits; one that has waited 3 takes the request "always" would give it
    fleet = many_small(100.0)
    pool = [WaitingRequest("a", 300), WaitingRequest("b", 100), WaitingRequest("c", 200)]
    idle = BalanceRouteParams.br0(s_greedy=2, guard="idle", step_overhead=0.0, patience=3)
    got, stats = route_round(fleet, pool, idle, reference=reference, waited=np.array([2, 2]))
    assert got == [] and stats.waited == [0, 1] and stats.patience_admissions == 0
    got, stats = route_round(fleet, pool, idle, reference=reference, waited=np.array([3, 2]))
    assert [(a.pool_index, a.worker, a.starvation_guard) for a in got] == [(1, 0, True)]
    assert stats.waited == [1] and stats.starvation_guard_admissions == 1
    assert stats.patience_admissions == 1  # the guard's admission is patience's
    # out of patience where idle would admit anyway (a fixed step cost that pays): the
    # guard's admissions are not patience's
    _, stats = route_round(fleet, pool, replace(idle, step_overhead=None), reference=reference,
                           waited=np.array([3, 3]))
    assert stats.starvation_guard_admissions == 2 and stats.patience_admissions == 0
    # no count given (a caller that keeps none), or no bound: nobody is out of patience
    assert route_round(fleet, pool, idle, reference=reference)[0] == []
    assert route_round(fleet, pool, replace(idle, patience=None), reference=reference,
                       waited=np.array([10**6, 10**6]))[0] == []
    # patience 0: never waits, the guard "always" (a caller that keeps no count included)
    always = route_round(fleet, pool, BalanceRouteParams.br0(s_greedy=2), reference=reference)
    assert route_round(fleet, pool, replace(idle, patience=0), reference=reference,
                       waited=np.zeros(2, dtype=int))[0] == always[0]
    assert route_round(fleet, pool, replace(idle, patience=0), reference=reference)[0] == \
        always[0]


def test_the_policy_counts_each_workers_waits_and_resets_after_an_admission():
    # the same fleet, routed round after round by the policy (nothing changes between
    # rounds): each worker waits 3 rounds, takes a request in the 4th (worker 0 first, by
    # the Stage-2 order; worker 1 in the same round), and its count starts again
    fleet = many_small(100.0)
    pool = [WaitingRequest("a", 300), WaitingRequest("b", 100), WaitingRequest("c", 200)]
    policy = make_policy("br0", params=BalanceRouteParams.br0(
        s_greedy=2, guard="idle", step_overhead=0.0, patience=3))
    admitted = [len(policy.route(fleet, pool).assignments) for _ in range(8)]
    assert admitted == [0, 0, 0, 2, 0, 0, 0, 2]
    # BR-H keeps the same count (its own rounds and its fallback's)
    brh = make_policy("brh", params=BalanceRouteParams(guard="idle", step_overhead=0.0,
                                                       s_greedy=2, patience=2))
    view = replace(fleet, active_c_hat=np.full(20, 80.0), pool_c_hat=np.full(3, 80.0))
    rounds = [brh.route(view if k % 2 else fleet, pool).assignments for k in range(6)]
    assert [len(r) for r in rounds] == [0, 0, 2, 0, 0, 2]
    # worker 0's admission is the guard's (F <= 0); after it BR-H's lookahead may see room
    # for worker 1's (the new request raises the projected maximum), BR-0's does not
    assert all(r[0].starvation_guard and r[0].worker == 0 for r in rounds if r)


def test_the_wait_count_starts_again_in_a_new_fleet():
    # the policy's count is per worker of the fleet it routes: a fleet of another size (a
    # rebuilt fleet, a reused policy) starts from zero instead of reading stale indices
    policy = make_policy("br0", params=BalanceRouteParams.br0(
        s_greedy=3, guard="idle", step_overhead=0.0, patience=2))  # 3 free slots: Stage 2
    pool = [WaitingRequest("a", 300), WaitingRequest("b", 100), WaitingRequest("c", 200)]
    two = many_small(100.0)
    assert [len(policy.route(two, pool).assignments) for _ in range(2)] == [0, 0]
    three = many_small(100.0, loads=(1000.0, 1000.0, 1000.0))
    pool.append(WaitingRequest("d", 400))  # more requests than the 3 free slots
    assert [len(policy.route(three, pool).assignments) for _ in range(3)] == [0, 0, 3]


def test_patience_must_be_a_whole_number_of_rounds():
    for bad in (-1, 1.5, True):
        with pytest.raises(ParameterError, match="patience"):
            BalanceRouteParams(patience=bad)  # type: ignore[arg-type]
    assert BalanceRouteParams(patience=0).as_br0().patience == 0
    assert BalanceRouteParams(patience=np.int64(3)).patience == 3  # numpy integers too


def test_the_guard_defaults_to_idle_for_brh_and_always_for_br0():
    assert BalanceRouteParams().effective_guard == "idle"
    assert BalanceRouteParams.br0().effective_guard == "always"
    assert BalanceRouteParams().as_br0().effective_guard == "always"  # BR-H's fallback
    assert BalanceRouteParams(guard="idle").as_br0().effective_guard == "idle"
    assert BalanceRouteParams.br0(guard="idle").effective_guard == "idle"


def test_stage2_defaults_differ_by_policy():
    """Unset, BR-0 takes BF-IO's subset rule with the widest margin first and BR-H the
    paper's Stage 2 (the F-best subset, workers by free slots): each default round equals the
    round with those settings given, and differs from the other settings' somewhere."""
    assert (BalanceRouteParams.br0().effective_stage2_fill,
            BalanceRouteParams.br0().effective_stage2_order) == (True, "margin")
    assert (BalanceRouteParams().effective_stage2_fill,
            BalanceRouteParams().effective_stage2_order) == (False, "slots")
    assert BalanceRouteParams.br0(stage2_fill=False).effective_stage2_fill is False
    assert BalanceRouteParams(stage2_order="margin").effective_stage2_order == "margin"
    rng = np.random.default_rng(21)
    differs = {0: False, 80: False}
    for _ in range(60):
        fleet = random_fleet(rng, 4, 8)
        pool = random_pool(rng, int(rng.integers(1, 12)))
        for horizon, mine, other in (
                (0, dict(stage2_fill=True, stage2_order="margin"),
                 dict(stage2_fill=False, stage2_order="slots")),
                (80, dict(stage2_fill=False, stage2_order="slots"),
                 dict(stage2_fill=True, stage2_order="margin"))):
            make = BalanceRouteParams.br0 if horizon == 0 else BalanceRouteParams
            default = route_round(fleet, pool, make())[0]
            assert default == route_round(fleet, pool, make(**mine))[0]
            differs[horizon] |= default != route_round(fleet, pool, make(**other))[0]
    assert all(differs.values())


@pytest.mark.parametrize("horizon", [0, 80])
def test_stage2_order_decides_which_worker_chooses_first(horizon):
    # G = 3, B = 4: worker 2 full at the envelope (100); worker 0 at 90 with 2 free slots
    # (margin 10), worker 1 at 88 with 1 free slot (margin 12). Four waiting requests: not a
    # short pool, and 3 free slots <= s_greedy, so Stage 2 alone decides.
    worker = np.array([0, 0, 1, 1, 1, 2, 2, 2, 2])
    size = np.array([45.0, 45.0, 30.0, 29.0, 29.0, 25.0, 25.0, 25.0, 25.0])
    c_hat = np.full(worker.size, 80.0) if horizon else None
    fleet = FleetView.from_active(3, 4, worker, size, c_hat)
    pool = [WaitingRequest(i, s) for i, s in enumerate([10, 4, 40, 40])]
    if horizon:
        fleet = replace(fleet, pool_c_hat=np.full(len(pool), 80.0))
    placed = {}
    for order in ("slots", "margin"):
        params = BalanceRouteParams(horizon=horizon, alpha=1.0, gamma=0.5,
                                    stage2_order=order) if horizon else \
            BalanceRouteParams.br0(stage2_order=order)
        got, stats = route_round(fleet, pool, params)
        assert stats.stage1_admissions == 0
        placed[order] = {a.pool_index: a.worker for a in got}
    # slots: worker 0 (two free slots) chooses first and takes the 10 (F 10; 10 + 4 would
    # overflow by 4: 14 - 3 * 4 = 2), worker 1 the 4; margin: worker 1 (margin 12) first
    assert placed["slots"] == {0: 0, 1: 1}
    assert placed["margin"] == {0: 1, 1: 0}


@pytest.mark.parametrize(
    "policy, loads, counts, want",
    [
        ("jsq", [5.0, 1.0, 9.0], [3, 2, 1], 2),
        ("ltl", [5.0, 1.0, 9.0], [3, 2, 1], 1),
        ("rr", [5.0, 1.0, 9.0], [3, 2, 1], 0),
    ],
)
def test_baselines_table(policy, loads, counts, want):
    fleet = FleetView(4, np.array(loads), np.array(counts), np.zeros(0, int), np.zeros(0))
    decision = make_policy(policy).route(fleet, [WaitingRequest("x", 10)])
    assert decision.assignments[0].worker == want


def test_round_robin_skips_full_workers_and_cycles():
    fleet = FleetView(2, np.zeros(3), np.array([0, 2, 0]), np.zeros(0, int), np.zeros(0))
    pool = [WaitingRequest(i, 1) for i in range(4)]
    got = [a.worker for a in make_policy("rr").route(fleet, pool).assignments]
    assert got == [0, 2, 0, 2]


def test_unknown_policy():
    with pytest.raises(UnknownPolicyError, match="nope"):
        make_policy("nope")


def test_expected_overflow_prefers_the_worker_whose_future_is_known():
    """Loads 500, 420, 900 (the envelope), one request each. Worker 0's may end now (p_fin
    0.3, mu_rem 1): its expected load from step 1 is 0.7 (500 + h), below worker 1's certain
    420 + h, but with a standard deviation of (500 + h) sqrt(0.21), about 230 tokens. A request
    of 600 overflows the envelope on either worker. Scored on the expected loads BR-H takes
    worker 0; scored by the expected overflow (the default) it takes worker 1, whose future is
    known. True lengths (c_hat only) have no spread: both settings decide alike."""
    kw = dict(active_c_hat=np.array([5.0, 10.0, 10.0]))
    law = dict(active_p_fin=np.array([0.3, 0.0, 0.0]),
               active_mu_rem=np.array([1.0, np.nan, np.nan]))
    loads = np.array([500.0, 420.0, 900.0])
    learned = FleetView(4, loads, np.array([1, 1, 1]), np.array([0, 1, 2]), loads, **kw, **law)
    pool = [WaitingRequest("a", 600)]
    params = BalanceRouteParams(horizon=10, gamma=0.9, end_points=0)
    got, _ = route_round(learned, pool, replace(params, expected_overflow=False))
    assert [a.worker for a in got] == [0]
    got, _ = route_round(learned, pool, params)
    assert [a.worker for a in got] == [1]
    assert build_table(learned, params).spread[0, 1] == pytest.approx(501 * np.sqrt(0.21))
    oracle = FleetView(4, loads, np.array([1, 1, 1]), np.array([0, 1, 2]), loads, **kw)
    assert build_table(oracle, params).spread is None
    assert ([a.worker for a in route_round(oracle, pool, params)[0]]
            == [a.worker for a in route_round(oracle, pool,
                                              replace(params, expected_overflow=False))[0]])


def test_a_short_pool_with_a_learned_law_is_placed_as_br0_places_it():
    """Worker 0's request ends now with probability 0.9 (learned law), so BR-H's lookahead sees
    worker 0 nearly empty from step 1 on; with true lengths (c_hat 1) it is surely empty. A
    short pool (one request, three free slots): with true lengths the lookahead places it (on
    worker 0); with the learned law the default places it as BR-0 does (largest first onto the
    least loaded, worker 1), and ``learned_short_pool=True`` by the lookahead (worker 0). A
    long pool is left to the lookahead either way."""
    loads = np.array([500.0, 400.0, 450.0])
    law = dict(active_p_fin=np.array([0.9, 0.0, 0.0]),
               active_mu_rem=np.array([1.0, np.nan, np.nan]))
    learned = FleetView(2, loads, np.array([1, 1, 1]), np.array([0, 1, 2]), loads,
                        active_c_hat=np.array([1.1, 10.0, 10.0]), **law)
    oracle = FleetView(2, loads, np.array([1, 1, 1]), np.array([0, 1, 2]), loads,
                       active_c_hat=np.array([1.0, 10.0, 10.0]))
    params = BalanceRouteParams(horizon=10, gamma=0.9)
    pool = [WaitingRequest("a", 300)]
    assert [a.worker for a in route_round(oracle, pool, params)[0]] == [0]
    assert [a.worker for a in route_round(learned, pool, params)[0]] == [1]
    assert [a.worker for a in route_round(learned, pool, BalanceRouteParams.br0())[0]] == [1]
    lookahead = replace(params, learned_short_pool=True)
    assert [a.worker for a in route_round(learned, pool, lookahead)[0]] == [0]
    # Two requests, a = 350 and b = 600: under a learned law short_pool is ignored (BR-0's
    # lpt: b onto worker 1, the least loaded, then a onto worker 2, now the least loaded);
    # with learned_short_pool it decides: lpt-fit (the default) takes b first and, as b does
    # not fit worker 1 (margin 100) now, by F onto worker 0 (nearly empty from step 1 on),
    # then a, which fits worker 1 under the new maximum, onto worker 1 (lpt by F alike);
    # best-pair takes a first (it fits worker 0), then b onto worker 1.
    two = [WaitingRequest("a", 350), WaitingRequest("b", 600)]
    as_br0 = [(a.pool_index, a.worker) for a in route_round(learned, two,
                                                            BalanceRouteParams.br0())[0]]
    for rule in ("lpt-fit", "lpt", "best-pair", "lpt-load"):
        got = route_round(learned, two, replace(params, short_pool=rule))[0]
        assert [(a.pool_index, a.worker) for a in got] == as_br0
    by_f = [(a.pool_index, a.worker) for a in route_round(learned, two, lookahead)[0]]
    pair = [(a.pool_index, a.worker) for a in route_round(
        learned, two, replace(lookahead, short_pool="best-pair"))[0]]
    assert as_br0 == [(1, 1), (0, 2)]
    assert by_f == [(1, 0), (0, 1)]
    assert pair == [(0, 0), (1, 1)]
    long_pool = [WaitingRequest(str(i), 300) for i in range(4)]  # 4 > 3 free slots
    assert (route_round(learned, long_pool, params)[0]
            == route_round(learned, long_pool, lookahead)[0])


def test_learned_beta_scale_weighs_only_a_learned_laws_overflow():
    """``learned_beta_scale=X``: with a learned law and ``beta`` unset the overflow weight is
    ``X * alpha * G``, so its rounds are exactly those of ``beta = X * alpha * G``; true lengths,
    BR-0 and an explicit ``beta`` are not scaled (same rounds as at scale 1), and a round of a
    one-step horizon is BR-0's only at scale 1."""
    rng = np.random.default_rng(11)
    scaled = BalanceRouteParams(horizon=12, gamma=0.8, alpha=1.5, learned_beta_scale=2.5)
    plain = replace(scaled, learned_beta_scale=1.0)
    changed = 0
    for _ in range(60):
        workers, active = 4, 10
        worker = rng.integers(0, workers, active)
        size = rng.integers(100, 3000, active).astype(np.float64)
        loads = np.bincount(worker, weights=size, minlength=workers)
        counts = np.bincount(worker, minlength=workers)
        c_hat = rng.uniform(1, 12, active)
        base = FleetView(4, loads, counts, worker, size, active_c_hat=c_hat)
        learned = replace(base, active_p_fin=rng.uniform(0, 1, active),
                          active_mu_rem=rng.uniform(0, 12, active))
        pool = [WaitingRequest(str(i), int(rng.integers(50, 4000))) for i in range(7)]
        assert build_table(learned, scaled).beta == pytest.approx(2.5 * 1.5 * workers)
        assert build_table(base, scaled).beta == pytest.approx(1.5 * workers)
        explicit = replace(scaled, beta=2.5 * 1.5 * workers, learned_beta_scale=1.0)
        assert route_round(learned, pool, scaled)[0] == route_round(learned, pool, explicit)[0]
        assert route_round(base, pool, scaled)[0] == route_round(base, pool, plain)[0]
        assert (route_round(learned, pool, replace(scaled, beta=7.0))[0]
                == route_round(learned, pool, replace(plain, beta=7.0))[0])
        changed += route_round(learned, pool, scaled)[0] != route_round(learned, pool, plain)[0]
    assert changed > 0  # the scale reaches the decisions
    br0 = BalanceRouteParams.br0(learned_beta_scale=2.5)
    assert build_table(replace(learned, active_c_hat=None), br0).beta == 4
    # every round below the myopic horizon (the turnover discount): BR-0's at scale 1 only
    loads = np.array([900.0, 300.0, 600.0])
    learned = FleetView(4, loads, np.array([1, 1, 1]), np.array([0, 1, 2]), loads,
                        active_c_hat=np.array([3.0, 9.0, 5.0]),
                        active_p_fin=np.array([0.8, 0.1, 0.4]),
                        active_mu_rem=np.array([2.0, 8.0, 4.0]))
    pool = [WaitingRequest(str(i), size) for i, size in enumerate((700, 200, 1500))]
    myopic = dict(horizon=12, myopic_horizon=1e6)
    assert route_round(learned, pool, BalanceRouteParams(**myopic))[1].extra.get("as_br0")
    assert not route_round(learned, pool, BalanceRouteParams(
        **myopic, learned_beta_scale=2.0))[1].extra.get("as_br0")
    for bad in (0.0, -1.0, float("inf"), float("nan"), 2e6):
        with pytest.raises(ParameterError, match="learned_beta_scale: must be a number > 0 "
                           "and at most 1e\\+06"):
            BalanceRouteParams(learned_beta_scale=bad)
    assert BalanceRouteParams(learned_beta_scale=1e6).learned_beta_scale == 1e6  # REST's bound


def test_expected_completions_under_the_law_match_ramp_by_ramp():
    """With the uniform end-time law, the breakpoint construction of n(t) equals evaluating
    every request's uniform ramp at every t (the O(n H) definition), steps (mu_rem 0)
    included."""
    from router_client.admission import expected_completions
    from router_client.projection import end_law

    rng = np.random.default_rng(3)
    horizon = 80
    for _ in range(200):
        n = int(rng.integers(1, 300))
        p_fin = rng.uniform(0, 1, n) * (rng.uniform(size=n) < 0.9)
        mu_rem = rng.uniform(0, horizon, n)
        mu_rem[rng.uniform(size=n) < 0.05] = 0.0
        fleet = FleetView(8, np.zeros(2), np.zeros(2, np.int64), np.zeros(n, np.int64),
                          np.ones(n), np.full(n, 5.0), None, p_fin, mu_rem)
        p, mu = end_law(p_fin, mu_rem, horizon)
        low = np.where(mu <= horizon / 2, 0.0, 2.0 * mu - horizon)
        width = np.maximum(np.where(mu <= horizon / 2, 2.0 * mu, float(horizon)) - low, 1e-12)
        t = np.arange(1, horizon + 1, dtype=np.float64)
        direct = p @ np.clip((t[None, :] - low[:, None]) / width[:, None], 0.0, 1.0)
        assert expected_completions(fleet, horizon, "uniform") == pytest.approx(direct,
                                                                                abs=1e-8)


def _density_mean(x: float) -> float:
    """The mean of the density ``exp(-x u)`` on [0, 1], by numerical integration."""
    from scipy.integrate import quad

    return (quad(lambda u: u * np.exp(-x * u), 0, 1)[0]
            / quad(lambda u: np.exp(-x * u), 0, 1)[0])


def test_expected_completions_under_the_exponential_law_match_numerical_integration():
    """The default law's n(t) against the end-time density ``exp(-x t / H)`` on [0, H]
    integrated numerically, its rate found by root-finding on its mean (scipy), for means
    from far below H/2 (front-loaded) to far above (loaded towards H)."""
    from scipy.integrate import quad

    from router_client.admission import expected_completions

    horizon = 40
    mu_rem = np.array([0.7, 3.0, 11.0, 20.0, 27.0, 38.5])
    p_fin = np.array([1.0, 0.9, 0.5, 0.3, 0.8, 0.6])
    n = mu_rem.size
    fleet = FleetView(8, np.zeros(2), np.zeros(2, np.int64), np.zeros(n, np.int64),
                      np.ones(n), np.full(n, 5.0), None, p_fin, mu_rem)
    t = np.arange(1, horizon + 1, dtype=np.float64)
    direct = np.zeros(horizon)
    for p, mu in zip(p_fin, mu_rem, strict=True):
        x = 0.0 if mu == horizon / 2 else brentq(
            lambda x, mu=mu: _density_mean(x) - mu / horizon, -200, 200)
        norm = quad(lambda u, x=x: np.exp(-x * u), 0, 1)[0]
        direct += p * np.array([quad(lambda u, x=x: np.exp(-x * u), 0, k / horizon)[0] / norm
                                for k in t])
    assert expected_completions(fleet, horizon) == pytest.approx(direct, abs=1e-6)


def test_short_pool_growth_by_slots_does_not_charge_a_worker_for_its_count():
    """A filling fleet (capacity 8): worker 0 at 380 tokens with 7 long requests, worker 1
    at 400 with 1. A 100-token request fits under the maximum nowhere (worker 0's margin is
    20), so ``lpt-fit`` scores it by F. By the requests held now worker 0 grows 7 tokens a
    step against 1 and passes worker 1 after 3 steps: overflows (100 + h) - margin are 80,
    87, 94, 101, then 104-110 on worker 0 against 100-103, then 100, 95, ..., 70 on worker 1:
    the lookahead takes worker 1, a raise of the maximum now (500 against 480). By slots
    (each free slot grows as an occupied one: both workers grow 8 a step) worker 0 stays 20
    under worker 1 and its overflow is 80 at every step against 100: worker 0, BR-0's choice.
    A long pool is not a short pool: the option changes nothing there."""
    sizes = np.array([60.0, 60.0, 60.0, 50.0, 50.0, 50.0, 50.0, 400.0])
    workers = np.array([0, 0, 0, 0, 0, 0, 0, 1])
    loads = np.array([380.0, 400.0])
    fleet = FleetView(8, loads, np.array([7, 1]), workers, sizes,
                      active_c_hat=np.full(8, 100.0))
    params = BalanceRouteParams(horizon=10, gamma=0.9, short_pool_growth="requests")
    pool = [WaitingRequest("a", 100)]
    assert [a.worker for a in route_round(fleet, pool, params)[0]] == [1]
    # the default, "filling", without a measured arrival rate: by requests
    default = BalanceRouteParams(horizon=10, gamma=0.9)
    assert default.short_pool_growth == "filling"
    assert [a.worker for a in route_round(fleet, pool, default)[0]] == [1]
    slots = replace(params, short_pool_growth="slots")
    assert [a.worker for a in route_round(fleet, pool, slots)[0]] == [0]
    assert [a.worker for a in route_round(fleet, pool, BalanceRouteParams.br0())[0]] == [0]
    long_pool = [WaitingRequest(str(i), 100) for i in range(9)]  # 9 > 8 free slots
    assert route_round(fleet, long_pool, params)[0] == route_round(fleet, long_pool, slots)[0]
    # "filling": by slots only while more arrivals are expected within the window than
    # completions (none of these 8 requests ends within it)
    filling = replace(params, short_pool_growth="filling")
    for rate, worker in ((None, 1), (0.0, 1), (0.05, 0)):  # 0.05 a step: 0.5 arrivals in 10
        view = replace(fleet, arrival_rate=rate)
        assert [a.worker for a in route_round(view, pool, filling)[0]] == [worker]
    # worker 1's request ends at step 9: 1 completion within the window against 0.5
    # arrivals, so not filling: by requests (worker 1), where by slots it is worker 0
    ending = replace(fleet, active_c_hat=np.array([100.0] * 7 + [9.0]), arrival_rate=0.05)
    assert [a.worker for a in route_round(ending, pool, params)[0]] == [1]
    assert [a.worker for a in route_round(ending, pool, slots)[0]] == [0]
    assert [a.worker for a in route_round(ending, pool, filling)[0]] == [1]
    with pytest.raises(ParameterError, match="short_pool_growth"):
        BalanceRouteParams(short_pool_growth="nope")  # type: ignore[arg-type]


def test_arrival_fill_growth_is_the_integral_of_the_chance_a_slot_is_taken():
    """A free slot's expected growth under ``short_pool_growth="arrivals"``: 8 free slots
    filled at 2 arrivals a step are all taken by step 4, so a slot has grown 2 * 3^2 / 16 =
    1.125 tokens by step 3 and 10 - 2 = 8 by step 10; against numerical integration of
    min(1, rate t / free) for other rates; None without a rate or a free slot."""
    growth = arrival_fill_growth(8, 2.0, 10)
    assert growth is not None
    assert growth[3] == pytest.approx(1.125) and growth[10] == pytest.approx(8.0)
    for free, rate in ((8, 0.05), (8, 100.0), (37, 1.3), (1, 0.2)):
        got = arrival_fill_growth(free, rate, 20)
        assert got is not None
        want = [quad(lambda t, r=rate, f=free: min(1.0, r * t / f), 0, h,
                     points=[free / rate])[0]
                for h in range(21)]
        assert got == pytest.approx(want, abs=1e-9)
    assert arrival_fill_growth(8, None, 10) is None
    assert arrival_fill_growth(8, 0.0, 10) is None
    assert arrival_fill_growth(0, 1.0, 10) is None


def test_short_pool_growth_by_arrivals_charges_the_free_slots_as_the_arrivals_fill_them():
    """The fleet of the test above (8 free slots, a 100-token request that fits nowhere).
    At 0.05 arrivals a step a free slot grows 0.31 tokens in the 10-step window: nearly the
    rule by requests, worker 1; at 0.5 a step it grows 3.1, enough that worker 0's 1 free
    slot against worker 1's 7 no longer charges worker 0 for its count: worker 0, as by
    slots. Without a measured rate: by requests."""
    sizes = np.array([60.0, 60.0, 60.0, 50.0, 50.0, 50.0, 50.0, 400.0])
    workers = np.array([0, 0, 0, 0, 0, 0, 0, 1])
    fleet = FleetView(8, np.array([380.0, 400.0]), np.array([7, 1]), workers, sizes,
                      active_c_hat=np.full(8, 100.0))
    params = BalanceRouteParams(horizon=10, gamma=0.9, short_pool_growth="arrivals")
    pool = [WaitingRequest("a", 100)]
    for rate, worker in ((None, 1), (0.05, 1), (0.5, 0), (100.0, 0)):
        view = replace(fleet, arrival_rate=rate)
        assert [a.worker for a in route_round(view, pool, params)[0]] == [worker]


def test_arrivals_growth_spans_requests_and_slots_on_random_short_pools():
    """``"arrivals"`` scores through the slot-growth path (``_slot_growth_scores``); the
    rule before scores through ``MarginTable.score_row_workers``. With arrivals too slow to
    fill a slot within the window (a curve of about 0) the two paths give the same round,
    and with arrivals that fill every slot at once (a curve of about h) ``"arrivals"`` gives
    ``"slots"``' round: on random fleets of small requests (loads close enough that growth
    decides) and short pools of several requests, where the free slots change from placement
    to placement, under ``lpt-fit`` and ``lpt``. The two rules differ in some of them."""
    rng = np.random.default_rng(23)
    decided = differ = 0
    for trial in range(200):
        counts = rng.integers(0, 9, 4)
        worker = np.repeat(np.arange(4), counts)
        fleet = FleetView.from_active(4, 8, worker, rng.integers(20, 120, worker.size) * 1.0,
                                      rng.uniform(1, 200, worker.size))
        pool = [WaitingRequest(f"r{i}", int(s))
                for i, s in enumerate(rng.integers(50, 400, int(rng.integers(2, 6))))]
        if len(pool) > int(fleet.free_slots.sum()):
            continue  # not a short pool
        base = BalanceRouteParams(horizon=40, gamma=0.95,
                                  short_pool="lpt" if trial % 2 else "lpt-fit")
        rounds = {}
        for rate, twin in ((1e-12, "requests"), (1e12, "slots")):
            view = replace(fleet, arrival_rate=rate)
            got = route_round(view, pool, replace(base, short_pool_growth="arrivals"))[0]
            rounds[twin] = route_round(view, pool, replace(base, short_pool_growth=twin))[0]
            assert got == rounds[twin], (trial, twin)
        decided += 1
        differ += rounds["requests"] != rounds["slots"]
    assert decided >= 150 and differ >= 20


def test_params_with_settings_reads_every_field_from_text():
    """:meth:`BalanceRouteParams.with_settings` (the proxy's ``--param``): every field's
    default, written as text, reads back to itself; values are read by the field's type;
    what a field cannot take is refused naming it."""
    import dataclasses

    base = BalanceRouteParams()

    def text(value):
        return "none" if value is None else str(value).lower() if isinstance(value, bool) \
            else str(value)

    every = {f.name: text(getattr(base, f.name)) for f in dataclasses.fields(base)}
    assert base.with_settings(every) == base
    got = base.with_settings({"horizon": "20", "beta": "12.5", "gamma": "never",
                              "learned_short_pool": "TRUE", "short_pool": "lpt",
                              "own_wait_horizon": "null"})
    assert got == replace(base, horizon=20, beta=12.5, gamma=None, learned_short_pool=True,
                          short_pool="lpt", own_wait_horizon=None)
    for settings, field in (({"nope": "1"}, "nope"), ({"horizon": "2.5"}, "horizon"),
                            ({"beta": "inf"}, "beta"), ({"alpha": "none"}, "alpha"),
                            ({"refill": "yes"}, "refill"), ({"stage1": "x"}, "stage1"),
                            ({"s_greedy": "-1"}, "s_greedy")):
        with pytest.raises(ParameterError, match=field):
            base.with_settings(settings)


def test_params_refuse_a_switch_that_is_not_true_or_false():
    """An embedding router builds ``BalanceRouteParams`` from Python: a switch given as text,
    a number or None (where the field cannot be unset) is refused naming the field, as REST,
    the CLI and ``--param`` refuse it; ``stage2_fill`` may be None (the policy's rule)."""
    switches = [f.name for f in dataclasses.fields(BalanceRouteParams)
                if f.type in ("bool", "bool | None")]
    assert {"stage2_revisit", "learned_short_pool", "stage2_fill"} <= set(switches)
    for name in switches:
        for bad in ("yes", 1, 0.0, np.float64(1.0)):
            with pytest.raises(ParameterError, match=f"^{name}: must be true or false"):
                BalanceRouteParams(**{name: bad})
        for good in (True, False):
            assert getattr(BalanceRouteParams(**{name: good}), name) is good
    assert BalanceRouteParams(stage2_fill=None).stage2_fill is None
    with pytest.raises(ParameterError, match="^stage2_revisit: must be true or false"):
        BalanceRouteParams(stage2_revisit=None)  # type: ignore[arg-type]
