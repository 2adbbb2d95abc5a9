"""Memory bounded in bytes: per-key curves sized by what a key holds, not by its lengths;
byte budgets on the keys and on the query cache; pending predictions admitted per caller."""

import numpy as np
import pytest
from lifelines import KaplanMeierFitter

from predictor.calibration import CalibrationTracker, Pending, Shadow
from predictor.estimators import ExactMatchEstimator, Features, Outcomes
from predictor.estimators.exact_match import Bucket, stacked_terms
from predictor.estimators.km import KaplanMeier, curve_terms


def _dense_terms(durations, events, generated, horizon):
    km = KaplanMeier().fit(durations, events)
    survival = km.survival_
    prefix = np.concatenate([[0.0], np.cumsum(survival)])
    return curve_terms(survival, prefix, generated, horizon)


@pytest.mark.parametrize("seed", range(5))
def test_bucket_step_curve_equals_the_dense_kaplan_meier_and_lifelines(seed):
    rng = np.random.default_rng(seed)
    durations = rng.integers(0, 3000, size=int(rng.integers(1, 200)))
    events = rng.random(durations.size) < 0.8
    bucket = Bucket(window=1000)
    bucket.add(durations, events)
    steps = bucket.steps()
    generated = rng.integers(0, 3500, size=300)
    owner = np.zeros(generated.size, dtype=np.int64)
    got = stacked_terms([steps], owner, generated, 80)
    want = _dense_terms(durations, events, generated, 80)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9)
    reference = KaplanMeierFitter().fit(durations, events)
    times = np.arange(0, 3000, 37)
    s_now = stacked_terms([steps], np.zeros(times.size, dtype=np.int64), times, 1)[0]
    np.testing.assert_allclose(s_now, reference.survival_function_at_times(times).to_numpy(),
                               atol=1e-9)


def test_a_key_with_a_huge_output_costs_kilobytes_and_answers_exactly():
    est = ExactMatchEstimator(window=100)
    est.partial_fit(Outcomes.of([1_048_576, 1_048_000, 20], [False, False, False],
                                ["poison", "poison", "ok"]))
    bucket = est.buckets_["poison"]
    assert bucket.nbytes < 2048
    assert bucket.durations.nbytes == 8  # two int32 lengths, not an array up to 1,048,576
    assert all(a.nbytes < 1024 for a in bucket.steps())
    # the answer is the blend of the key's exact curve (no ends: S = 1) and the global one
    answer = est.predict(Features.of([1_000_000], ["poison"]), 80)
    assert answer.source == ["exact_match"] and answer.c_hat[0] == pytest.approx(80.0)


def test_the_keys_are_bounded_in_bytes_least_recently_updated_evicted_first():
    est = ExactMatchEstimator(window=50, bucket_window=256, max_bytes=200_000)
    rng = np.random.default_rng(1)
    for start in range(0, 3000, 100):
        keys = [f"k{i}" for i in range(start, start + 100)]
        est.partial_fit(Outcomes.of(rng.integers(1, 1 << 20, 100), None, keys))
        assert est.bytes_ <= 200_000
    assert est.bytes_ == sum(b.nbytes + len(k) for k, b in est.buckets_.items())
    assert "k2999" in est.buckets_ and "k0" not in est.buckets_


def test_the_query_cache_is_bounded_in_bytes_and_answers_do_not_change():
    est = ExactMatchEstimator(window=500, cache_bytes=100_000)
    rng = np.random.default_rng(2)
    keys = [f"k{i}" for i in range(2000)]
    est.partial_fit(Outcomes.of(rng.integers(1, 5000, 4000), None, keys * 2))
    query = Features.of(rng.integers(0, 6000, 2000), keys)
    first = est.predict(query, 80)
    assert est.steps_bytes_ <= 100_000 and len(est._steps) < 2000
    again = est.predict(query, 80)  # mostly recomputed: the same answers
    np.testing.assert_array_equal(first.c_hat, again.c_hat)
    # a key that learns drops its cached curve
    est.partial_fit(Outcomes.of([7], None, ["k1999"]))
    assert "k1999" not in est._steps


def test_the_global_curve_gives_its_memory_back_once_a_huge_output_left_the_window():
    km = KaplanMeier(window=100).fit([1_000_000], [True])
    assert km.events_.shape[0] > 1_000_000
    for _ in range(3):
        km.partial_fit(np.full(100, 50), np.ones(100, dtype=bool))
    assert km.events_.shape[0] <= 4096
    np.testing.assert_allclose(km.survival_at(np.array([0, 49, 50, 60])), [1, 1, 0, 0])


def _shadow():
    return (Shadow("survival", 0.5, 10.0, True),)


def test_one_callers_junk_cannot_evict_another_callers_pending_predictions():
    tracker = CalibrationTracker(["survival"], sample_rate=1.0, max_pending=1000, per_caller=250)
    for i in range(100):
        tracker.record(f"real{i}", Pending(3, 20, _shadow()), caller="10.0.0.1")
    for i in range(40 * 500):  # 40 queries of 500 junk ids from another caller
        tracker.record(f"junk{i}", Pending(0, 20, _shadow()), caller="10.0.0.9")
    assert tracker.caller_count == {"10.0.0.1": 100, "10.0.0.9": 250}
    assert tracker.dropped == 40 * 500 - 250
    assert all(tracker.resolve(f"real{i}", 10, False) for i in range(100))
    assert len(tracker.pending) == 250  # dropped junk leaves no entry behind
    assert tracker.pending_count == 250


def test_when_full_the_caller_holding_the_most_loses_its_oldest():
    tracker = CalibrationTracker(["survival"], sample_rate=1.0, max_pending=10, per_caller=8)
    for i in range(8):
        tracker.record(f"a{i}", Pending(0, 20, _shadow()), caller="a")
    for i in range(4):
        tracker.record(f"b{i}", Pending(0, 20, _shadow()), caller="b")
    assert tracker.caller_count == {"a": 6, "b": 4} and tracker.dropped == 2
    assert tracker.resolve("a0", 5, False) == [] and tracker.resolve("a2", 5, False)
    assert all(tracker.resolve(f"b{i}", 5, False) for i in range(4))
    # resolving frees slots; the bookkeeping stays bounded over many rounds
    for i in range(5000):
        tracker.record(f"c{i}", Pending(0, 20, _shadow()), caller="c")
        tracker.resolve(f"c{i}", 5, False)
    assert len(tracker.callers.get("c", ())) == 0 and tracker.pending_count == 5


def test_junk_queries_from_one_address_keep_another_addresss_pending_predictions(tmp_path):
    from fastapi.testclient import TestClient

    from predictor.app import create_app
    from predictor.settings import Settings

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'fair.db'}",
                        calibration_sample_rate=1.0, calibration_max_pending=2000,
                        estimators="survival,exact_match")
    app = create_app(settings)
    with TestClient(app, client=("10.0.0.1", 5000)) as router, \
            TestClient(app, client=("10.6.6.6", 5000)) as junk:
        router.post("/v1/observations", json={"observations": [
            {"request_id": f"old{i}", "output_tokens": 10 + i} for i in range(50)]})
        real = [f"real{i}" for i in range(300)]
        assert router.post("/v1/contributions", json={"items": [
            {"request_id": r, "generated_tokens": 3} for r in real]}).status_code == 200
        for q in range(40):  # 40 queries of junk ids from another address
            assert junk.post("/v1/contributions", json={"items": [
                {"request_id": f"junk{q}-{i}", "generated_tokens": 1}
                for i in range(1000)]}).status_code == 200
        tracker = app.state.service.tracker
        assert all(r in tracker.pending for r in real)
        report = router.get("/v1/calibration").json()
        assert report["pending"] == 300 + 500 and report["pending_dropped"] == 40_000 - 500
        router.post("/v1/observations", json={"observations": [
            {"request_id": r, "output_tokens": 5} for r in real]})
        assert tracker.caller_count.get("10.0.0.1", 0) == 0  # every real one was scored
