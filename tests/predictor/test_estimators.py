import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lifelines import KaplanMeierFitter

from predictor.estimators import (
    PRIOR,
    ExactMatchEstimator,
    Features,
    NotFittedError,
    Outcomes,
    SurvivalEstimator,
)
from predictor.estimators.km import KaplanMeier, residual_life

SURVIVAL, EXACT_MATCH = "survival", "exact_match"


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 400), top=st.integers(1, 300),
       censor_rate=st.floats(0.0, 0.9))
def test_kaplan_meier_matches_lifelines(seed, n, top, censor_rate):
    rng = np.random.default_rng(seed)
    durations = rng.integers(0, top, n)
    events = rng.random(n) >= censor_rate
    km = KaplanMeier().fit(durations, events)
    reference = KaplanMeierFitter().fit(durations, events)
    times = np.arange(0, top + 5)
    want = reference.survival_function_at_times(times).to_numpy()
    np.testing.assert_allclose(km.survival_at(times), want, atol=1e-9, rtol=0)


def test_online_updates_equal_a_batch_fit():
    rng = np.random.default_rng(5)
    durations = rng.integers(0, 100, 1000)
    events = rng.random(1000) > 0.2
    online = KaplanMeier()
    for chunk in range(0, 1000, 37):
        online.partial_fit(durations[chunk:chunk + 37], events[chunk:chunk + 37])
    np.testing.assert_array_equal(online.survival_, KaplanMeier().fit(durations, events).survival_)


def test_window_keeps_exactly_the_most_recent_observations():
    rng = np.random.default_rng(6)
    durations = rng.integers(0, 60, 500)
    events = rng.random(500) > 0.3
    windowed = KaplanMeier(window=120)
    for chunk in range(0, 500, 50):
        windowed.partial_fit(durations[chunk:chunk + 50], events[chunk:chunk + 50])
    recent = KaplanMeierFitter().fit(durations[-120:], events[-120:])
    times = np.arange(0, 65)
    np.testing.assert_allclose(windowed.survival_at(times),
                               recent.survival_function_at_times(times).to_numpy(), atol=1e-9)
    assert windowed.n_observed_ == 120


def direct_residual(durations, events, a, horizon):
    """c_hat, p_fin, mu_rem straight from lifelines' curve, one term at a time."""
    reference = KaplanMeierFitter().fit(durations, events)

    def S(t):
        return float(reference.survival_function_at_times([t]).iloc[0])

    s_a = S(a)
    c = sum(S(a + h) / s_a for h in range(horizon))
    p = 1 - S(a + horizon) / s_a
    mu = (c - (1 - p) * horizon) / p if p > 0 else None
    return c, p, mu


@pytest.mark.parametrize("a, horizon", [(0, 10), (5, 20), (30, 80), (0, 1)])
def test_residual_life_against_direct_computation(a, horizon):
    rng = np.random.default_rng(7)
    durations = rng.integers(1, 90, 300)
    events = rng.random(300) > 0.25
    km = KaplanMeier().fit(durations, events)
    life = residual_life(km.survival_, np.array([a]), horizon)
    c, p, mu = direct_residual(durations, events, a, horizon)
    assert life.c_hat[0] == pytest.approx(c, abs=1e-9)
    assert life.p_fin[0] == pytest.approx(p, abs=1e-9)
    if mu is None:
        assert np.isnan(life.mu_rem[0])
    else:
        assert life.mu_rem[0] == pytest.approx(mu, abs=1e-9)
    # c = (1 - p) * H + p * mu, the decomposition c = (1 - p_fin) H + p_fin mu_rem
    if mu is not None:
        assert life.c_hat[0] == pytest.approx((1 - p) * horizon + p * mu)


def test_residual_life_by_hand():
    # every output is exactly 10 tokens: S(t) = 1 for t < 10, 0 after
    km = KaplanMeier().fit([10] * 5, [True] * 5)
    life = residual_life(km.survival_, np.array([0, 4, 9]), 80)
    np.testing.assert_allclose(life.c_hat, [10, 6, 1])
    np.testing.assert_allclose(life.p_fin, [1, 1, 1])
    np.testing.assert_allclose(life.mu_rem, [10, 6, 1])


def test_past_the_observed_range_is_the_conservative_prior():
    km = KaplanMeier().fit([10, 20], [True, True])  # S hits 0 at 20
    life = residual_life(km.survival_, np.array([25]), 50)
    assert life.c_hat[0] == 50 and life.p_fin[0] == 0 and np.isnan(life.mu_rem[0])
    # a censored longest observation: the curve stays flat above 0 beyond it
    km = KaplanMeier().fit([10, 20], [True, False])
    life = residual_life(km.survival_, np.array([30]), 50)
    assert life.c_hat[0] == 50 and life.p_fin[0] == 0


def test_no_history_gives_the_prior():
    with pytest.raises(NotFittedError):
        _ = KaplanMeier().survival_
    answer = SurvivalEstimator().predict(Features.of([0, 3]), 80)
    assert answer.source == [PRIOR, PRIOR]
    np.testing.assert_array_equal(answer.c_hat, [80, 80])
    np.testing.assert_array_equal(answer.p_fin, [0, 0])


def test_exact_match_uses_buckets_with_support_and_falls_back():
    est = ExactMatchEstimator(window=0, min_support=3, prior_weight=1.0, estimate_weight=False)
    est.partial_fit(Outcomes.of([5, 5, 5, 100, 100], prompt_key=["a", "a", "a", "b", "b"]))
    answer = est.predict(Features.of([0, 0, 0, 0], ["a", "b", None, "zzz"]), 80)
    assert answer.source == [EXACT_MATCH, SURVIVAL, SURVIVAL, SURVIVAL]
    # bucket a (always 5 tokens): c = 5; global: 5 + 75 * 0.4 = 35; blended 3:1 -> 12.5
    assert answer.c_hat[0] == pytest.approx((3 * 5 + 1 * 35) / 4)
    assert answer.c_hat[1] == pytest.approx(35.0)
    assert list(answer.support) == [3, 5, 5, 5]


def test_exact_match_bucket_count_is_bounded():
    est = ExactMatchEstimator(max_buckets=10, min_support=1)
    for i in range(100):
        est.partial_fit(Outcomes.of([i + 1], prompt_key=[f"k{i}"]))
    assert len(est.buckets_) == 10 and est.n_groups_ == 10
    assert list(est.buckets_)[-1] == "k99" and "k0" not in est.buckets_


def test_windowed_survival_tracks_a_shift():
    est = SurvivalEstimator(window=500)
    est.partial_fit(Outcomes.of(np.full(2000, 10)))
    before = est.predict(Features.of([0]), 80).c_hat[0]
    est.partial_fit(Outcomes.of(np.full(500, 60)))
    after = est.predict(Features.of([0]), 80).c_hat[0]
    assert before == pytest.approx(10) and after == pytest.approx(60)


def test_fit_is_reset_plus_partial_fit():
    est = ExactMatchEstimator(window=0, min_support=1)
    est.partial_fit(Outcomes.of([500, 600], prompt_key=["old", "old"]))
    est.fit(Outcomes.of([5, 5], prompt_key=["new", "new"]))
    assert est.n_observed_ == 2 and list(est.buckets_) == ["new"]
    fresh = ExactMatchEstimator(window=0, min_support=1).partial_fit(
        Outcomes.of([5, 5], prompt_key=["new", "new"]))
    features = Features.of([0, 2], ["new", "old"])
    np.testing.assert_array_equal(est.predict(features, 80).c_hat,
                                  fresh.predict(features, 80).c_hat)


def test_prediction_does_not_change_the_estimator():
    est = ExactMatchEstimator(window=0, min_support=1).partial_fit(
        Outcomes.of([5, 9, 30], prompt_key=["a", "a", None]))
    features = Features.of([0, 1, 2], ["a", "b", None], [100, 200, None])
    first = est.predict(features, 40)
    second = est.predict(features, 40)
    np.testing.assert_array_equal(first.c_hat, second.c_hat)
    assert first.source == second.source


def test_features_take_keeps_every_column():
    features = Features.of([0, 1, 2], ["a", None, "c"], [10, None, 30])
    sub = features.take([2, 0])
    assert sub.prompt_key == ["c", "a"]
    np.testing.assert_array_equal(sub.generated, [2, 0])
    np.testing.assert_array_equal(sub.prompt_tokens, [30, 10])
    assert features.prompt_tokens[1] == -1  # unknown


def test_running_requests_count_as_censored_at_their_age():
    rng = np.random.default_rng(11)
    durations = rng.integers(1, 80, 300)
    events = rng.random(300) > 0.2
    running = rng.integers(1, 120, 40)
    km = KaplanMeier().fit(durations, events).set_running(running)
    longest = km.events_.shape[0] - 1
    reference = KaplanMeierFitter().fit(
        np.concatenate([durations, np.minimum(running, longest)]),
        np.concatenate([events, np.zeros(40, bool)]))
    times = np.arange(0, 90)
    np.testing.assert_allclose(km.survival_at(times),
                               reference.survival_function_at_times(times).to_numpy(),
                               atol=1e-9)
    assert km.n_observed_ == 300  # running requests are evidence, not observations
    est = SurvivalEstimator(window=0).partial_fit(Outcomes.of(durations, ~events))
    before = est.predict(Features.of([0]), 80).c_hat[0]
    est.observe_running(Features.of(np.full(50, 79)))  # many long-running requests
    after = est.predict(Features.of([0]), 80).c_hat[0]
    assert after > before  # the curve no longer forgets the long ones still running
    est.observe_running(Features.of([]))
    assert est.predict(Features.of([0]), 80).c_hat[0] == pytest.approx(before)


def test_thin_tail_gets_one_pooled_hazard_worked_by_hand():
    """1,000 requests of lengths 1..1000, no censoring. At age t, 1001 - t are at risk, fewer
    than 50 from t = 952 on (50 < a tenth of 1000). The plain curve is S(t) = (1000 - t)/1000;
    the tail's 49 events over an exposure of 49 + 48 + ... + 1 = 1225 request-steps give one
    hazard 49/1225 = 0.04, so S(951 + k) = 0.049 * 0.96^k, instead of falling to 0 at 1000."""
    durations = np.arange(1, 1001)
    events = np.ones(1000, dtype=bool)
    plain = KaplanMeier().fit(durations, events)
    pooled = KaplanMeier(tail_at_risk=50).fit(durations, events)
    body = np.arange(0, 952)
    np.testing.assert_allclose(pooled.survival_at(body), (1000 - body) / 1000, atol=1e-12)
    np.testing.assert_allclose(plain.survival_at(body), pooled.survival_at(body), atol=1e-12)
    k = np.arange(0, 50)
    np.testing.assert_allclose(pooled.survival_at(951 + k), 0.049 * 0.96 ** k, rtol=1e-9)
    assert plain.survival_at(1000) == 0.0 and pooled.survival_at(1000) > 0.005
    # A request at age 990: the plain curve says it ends within 80 for sure (p_fin 1); the
    # pooled one says 1 - 0.96^10, the tail's own rate, for the 10 steps the curve covers.
    life = residual_life(pooled.survival_, np.array([990]), 80)
    assert life.p_fin[0] == pytest.approx(1 - 0.96 ** 10, rel=1e-9)
    assert residual_life(plain.survival_, np.array([990]), 80).p_fin[0] == pytest.approx(1.0)


def test_pooled_tail_leaves_small_samples_and_rich_tails_alone():
    rng = np.random.default_rng(5)
    small = rng.integers(1, 300, 40)  # a tenth of 40 is 4: only the last few ages pool
    few = KaplanMeier(tail_at_risk=50).fit(small, np.ones(40, bool))
    plain = KaplanMeier().fit(small, np.ones(40, bool))
    ages = np.arange(0, int(np.sort(small)[-4]))
    np.testing.assert_array_equal(few.survival_at(ages), plain.survival_at(ages))
    # Every age with 50 or more at risk keeps its plain estimate, censoring included.
    durations = rng.integers(1, 2000, 5000)
    events = rng.random(5000) > 0.3
    plain = KaplanMeier().fit(durations, events)
    pooled = KaplanMeier(tail_at_risk=50).fit(durations, events)
    at_risk = np.array([(durations >= t).sum() for t in range(2001)])
    rich = np.flatnonzero(at_risk >= 50)
    np.testing.assert_allclose(pooled.survival_at(rich), plain.survival_at(rich), atol=1e-12)
    assert SurvivalEstimator().tail_at_risk == 50  # the default; 0 is plain Kaplan-Meier
    with pytest.raises(ValueError, match="tail_at_risk"):
        KaplanMeier(tail_at_risk=-1)
