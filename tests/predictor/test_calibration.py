
import numpy as np
import pytest
from fastapi.testclient import TestClient

from predictor.app import create_app
from predictor.calibration import (
    CalibrationTracker,
    DriftMonitor,
    Pending,
    Scored,
    Shadow,
    reliability,
    sampled,
    sampled_rows,
    score_outcome,
    summarize,
)
from predictor.settings import Settings
from router_client.policies import make_policy
from router_client.simulator import SimConfig, simulate
from router_client.synth import synthesize
from router_client.traces import load_trace

# Golden values: the observation index at which the length detector flags synth:shift
# (n=20000, the distribution changes at index 10000), and a 6x rise of the median output after
# 1,500 observations of a fresh service. Pinned so a change of detector or parameters is
# noticed. Bound: a recent window (300) plus the confirmation (100) plus one check (50).
SHIFT_DETECTION_INDEX = 10399
YOUNG_SHIFT_DETECTION_INDEX = 1899
DETECTION_BOUND = 450


def six_fold(seed: int = 0, n: int = 6000):
    """Lognormal outputs whose median rises 6x (about 165 to 1000) at observation 1500."""
    return synthesize(f"synth:shift:n={n},before_mean=200,after_mean=1200,"
                      f"shift_at={1500 / n},seed={seed}").output_tokens


def completion_order(trace, **config):
    """Output lengths in the order a replay (BR-0, G = 8, B = 64) finishes them."""
    result = simulate(trace, make_policy("br0"), SimConfig(**config), None)
    order = np.lexsort((np.arange(len(trace)), result.finish_step))
    return trace.output_tokens[order]


def test_stationary_stream_raises_no_drift():
    outputs = synthesize("synth:long:n=50000,seed=11").output_tokens
    monitor = DriftMonitor()
    fired = [i for i, o in enumerate(outputs) if monitor.update_length(int(o))]
    assert fired == []
    assert not monitor.drifted


def test_stationary_calibration_loss_raises_no_drift():
    rng = np.random.default_rng(3)
    p = rng.random(50000)
    y = rng.random(50000) < p
    monitor = DriftMonitor()
    fired = [i for i in range(50000) if monitor.update_loss(float((p[i] - y[i]) ** 2))]
    assert fired == []


def test_shift_is_flagged_within_a_bounded_number_of_observations():
    outputs = synthesize("synth:shift").output_tokens
    monitor = DriftMonitor()
    fired = [i for i, o in enumerate(outputs) if monitor.update_length(int(o))]
    assert fired, "the shift was not detected"
    assert all(i >= 10000 for i in fired), "a false alarm before the shift"
    assert fired[0] - 10000 <= DETECTION_BOUND
    assert fired[0] == SHIFT_DETECTION_INDEX
    # armed after the alarm: it keeps detecting until the reference has caught up ...
    assert monitor.length.last_detection == 12099
    assert not monitor.drifted  # ... and 5000 quiet observations later the flag has cleared


def test_a_young_service_sees_a_sixfold_shift():
    """Issue 12: a median output rising 6x after 1,500 observations of a fresh service was
    never flagged (the old detectors needed 3,300 samples first)."""
    for seed in range(3):
        outputs = six_fold(seed)
        assert np.median(outputs[1500:]) > 5.5 * np.median(outputs[:1500])
        monitor = DriftMonitor()
        fired = [i for i, o in enumerate(outputs) if monitor.update_length(int(o))]
        assert fired and fired[0] >= 1500, "a false alarm before the shift"
        assert fired[0] - 1500 <= DETECTION_BOUND < 500
        if seed == 0:
            assert fired[0] == YOUNG_SHIFT_DETECTION_INDEX
        assert monitor.drifted


def test_the_detector_stays_armed_after_an_alarm():
    """Up 6x at 1500, back down at 3000: the second change is seen as quickly as the first
    (the old detectors cleared both windows and were blind for 3,300 samples)."""
    outputs = six_fold(0)
    stream = np.concatenate([outputs[:3000], outputs[:1500]])
    monitor = DriftMonitor()
    fired = [i for i, o in enumerate(stream) if monitor.update_length(int(o))]
    assert fired[0] == YOUNG_SHIFT_DETECTION_INDEX
    back = [i for i in fired if i >= 3000]
    assert back and back[0] - 3000 <= DETECTION_BOUND
    assert back[0] == 3399


@pytest.mark.parametrize("requests", [4000, None])
def test_no_alarm_on_the_azure_trace_in_completion_order(requests, shared_traces):
    """The real Azure 2023 trace, fed as a replay finishes it (the short requests first as
    it fills, the longest last as it drains): its ordinary mix changes and the drain raise
    no alarm (``make demo`` replays its first 4000 requests; it used to end in an alarm)."""
    trace = load_trace(str(shared_traces / "AzureLLMInferenceTrace_conv.csv"))
    if requests:
        trace = trace.head(requests)
    monitor = DriftMonitor()
    outputs = completion_order(trace, workers=8, batch=64, load=1.0)
    fired = [i for i, o in enumerate(outputs) if monitor.update_length(int(o))]
    assert fired == []
    assert monitor.length.detector.blocked >= 1  # the drain was seen, and not taken for drift


def test_hysteresis_holds_the_flag_then_clears_without_flapping():
    outputs = synthesize("synth:shift").output_tokens
    monitor = DriftMonitor(clear_after=3000)
    states = []
    for o in outputs:
        monitor.update_length(int(o))
        states.append(monitor.drifted)
    states = np.asarray(states)
    transitions = int(np.count_nonzero(np.diff(states.astype(int))))
    assert states[SHIFT_DETECTION_INDEX] and not states[SHIFT_DETECTION_INDEX - 1]
    last = monitor.length.last_detection
    assert states[last + 2999] and not states[last + 3000]
    assert transitions == 2  # up once, down once


def test_score_outcome_cases():
    pending = Pending(10, 50, (Shadow("survival", 0.7, 30.0, False),))
    ended = score_outcome(pending, 40, censored=False)  # remaining 30 <= 50
    assert ended[0].ended and ended[0].realized == 30
    later = score_outcome(pending, 100, censored=False)  # remaining 90 > 50
    assert not later[0].ended and later[0].realized == 50
    assert score_outcome(pending, 40, censored=True) == []  # cut at 30 < H: open
    cut_late = score_outcome(pending, 70, censored=True)  # cut at 60 >= H: did not end
    assert not cut_late[0].ended and cut_late[0].realized == 50
    assert score_outcome(pending, 10, censored=False) == []  # inconsistent: not after


def test_calibration_figures_by_hand():
    p = np.array([0.05, 0.15, 0.15, 0.95])
    y = np.array([0, 1, 0, 1], dtype=bool)
    c = np.array([10.0, 20.0, 30.0, 5.0])
    realized = np.array([12.0, 20.0, 25.0, 5.0])
    report = summarize(p, y, c, realized, np.array([1, 0, 1, 1], bool), "exact_match")
    assert report["scored"] == 4
    assert report["brier"] == pytest.approx((0.05**2 + 0.85**2 + 0.15**2 + 0.05**2) / 4)
    bins = {round(b["lo"], 1): b for b in report["bins"] if b["count"]}
    assert bins[0.0]["count"] == 1 and bins[0.0]["observed"] == 0.0
    assert bins[0.1]["count"] == 2 and bins[0.1]["mean_pred"] == pytest.approx(0.15)
    assert bins[0.1]["observed"] == 0.5 and bins[0.9]["observed"] == 1.0
    want_ece = (1 * 0.05 + 2 * abs(0.15 - 0.5) + 1 * 0.05) / 4
    assert report["ece"] == pytest.approx(want_ece)
    assert report["mae_c_hat"] == pytest.approx((2 + 0 + 5 + 0) / 4)
    assert report["exact_match_hit_rate"] == pytest.approx(0.75)


def test_well_calibrated_scores_near_zero_biased_does_not():
    rng = np.random.default_rng(8)
    p = rng.random(20000)
    y = rng.random(20000) < p
    _, good = reliability(p, y.astype(float))
    _, biased = reliability(p, (rng.random(20000) < p / 2).astype(float))
    assert good < 0.02
    assert biased > 0.2


def test_tracker_bounds_and_windows():
    tracker = CalibrationTracker(["survival", "exact_match"], sample_rate=1.0, max_pending=3,
                                 capacity=5)
    shadow = (Shadow("survival", 0.5, 10.0, False),)
    for i in range(5):
        tracker.record(f"r{i}", Pending(0, 20, shadow))
    assert tracker.pending_count == 3 and tracker.dropped == 2
    assert tracker.resolve("r0", 5, False) == []  # dropped, oldest first
    for i in range(8):
        tracker.add_scored(Scored("survival", 20, 0, i / 10, 1.0, bool(i % 2), 1.0, False))
    report = tracker.report(estimator="survival")
    assert report[0]["scored"] == 5  # capacity
    assert tracker.report(estimator="survival", window=2)[0]["scored"] == 2
    assert tracker.report(horizon=7)[0]["scored"] == 0


def test_sampling_is_deterministic_and_near_the_rate():
    picks = [sampled(f"r{i}", i % 50, 0.1) for i in range(20000)]
    assert picks == [sampled(f"r{i}", i % 50, 0.1) for i in range(20000)]
    assert 0.08 < np.mean(picks) < 0.12


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5, 0.999, 1.0])
def test_sampled_rows_are_the_sampled_items(rate):
    ids = [f"r{i}" for i in range(3000)] + ["é\u2603", "x" * 128]
    generated = [i % 400 for i in range(len(ids))]
    assert sampled_rows(ids, generated, rate) == [
        i for i in range(len(ids)) if sampled(ids[i], generated[i], rate)]


def settings_for(tmp_path, **overrides):
    return settings_at(f"sqlite:///{tmp_path / 'cal.db'}", **overrides)


def settings_at(url, **overrides):
    return Settings(database_url=url, calibration_sample_rate=1.0, exact_match_min_support=3,
                    **overrides)


def _drive(client, rng, n_requests, key_lengths, start=0):
    """Ask for predictions of fresh requests, then report their outcomes."""
    ids = [f"q{start + i}" for i in range(n_requests)]
    keys = [f"k{i % len(key_lengths)}" for i in range(n_requests)]
    generated = rng.integers(0, 5, n_requests)
    client.post("/v1/contributions", json={"horizon": 20, "items": [
        {"request_id": r, "prompt_key": k, "generated_tokens": int(g)}
        for r, k, g in zip(ids, keys, generated, strict=True)]})
    outputs = [int(key_lengths[i % len(key_lengths)] + rng.integers(5, 8))
               for i in range(n_requests)]
    client.post("/v1/observations", json={"observations": [
        {"request_id": r, "prompt_key": k, "output_tokens": o}
        for r, k, o in zip(ids, keys, outputs, strict=True)]})


def test_calibration_endpoint_shadow_scores_both_estimators(database_url):
    rng = np.random.default_rng(0)
    with TestClient(create_app(settings_at(database_url))) as client:
        # keys with very different lengths: one short (ends within H=20), one long (does not)
        for round_ in range(6):
            _drive(client, rng, 40, [3, 60], start=round_ * 40)
        report = client.get("/v1/calibration").json()
        by_name = {e["estimator"]: e for e in report["estimators"]}
        assert set(by_name) == {"survival", "exact_match", "hazard"}  # every registered one
        assert by_name["survival"]["scored"] == by_name["exact_match"]["scored"] > 0
        assert by_name["hazard"]["scored"] == by_name["survival"]["scored"]
        # ExactMatch knows which key is short: it must be better calibrated than Survival
        assert by_name["exact_match"]["brier"] < by_name["survival"]["brier"]
        assert by_name["exact_match"]["exact_match_hit_rate"] > 0.5
        assert report["drift"]["drifted"] is False  # a stationary mix raises no alarm
        unknown = client.get("/v1/calibration", params={"estimator": "nope"})
        assert unknown.status_code == 422 and unknown.json()["detail"][0]["loc"] == [
            "query", "estimator"]
        only = client.get("/v1/calibration", params={"estimator": "survival", "window": 10})
        assert [e["estimator"] for e in only.json()["estimators"]] == ["survival"]
        assert only.json()["estimators"][0]["scored"] == 10
        none = client.get("/v1/calibration", params={"horizon": 7}).json()
        assert all(e["scored"] == 0 for e in none["estimators"])
        png = client.get("/v1/calibration.png")
        assert png.status_code == 200 and png.headers["content-type"] == "image/png"
        assert png.content[:8] == b"\x89PNG\r\n\x1a\n"
        again = client.get("/v1/calibration.png")  # served from the cache: the same bytes
        assert again.content == png.content
        assert client.get("/v1/calibration", params={"window": 0}).status_code == 422
        assert client.get("/v1/calibration", params={"estimator": "x"}).status_code == 422
        metrics = client.get("/metrics").text
        assert 'balanceroute_calibration_ece{estimator="exact_match"}' in metrics
        assert "balanceroute_drifted" in metrics
        before = client.get("/v1/calibration").json()
    with TestClient(create_app(settings_at(database_url))) as client:
        after = client.get("/v1/calibration").json()
    for key in ("estimators", "drift"):
        assert after[key] == before[key]


def test_shift_through_the_api_sets_drifted_everywhere(tmp_path):
    outputs = synthesize("synth:shift").output_tokens
    with TestClient(create_app(settings_for(tmp_path))) as client:
        for start in range(0, 11000, 1000):
            client.post("/v1/observations", json={"observations": [
                {"request_id": f"o{i}", "output_tokens": int(outputs[i])}
                for i in range(start, start + 1000)]})
        status = client.get("/v1/status").json()
        assert status["drifted"] is True
        answer = client.post("/v1/contributions", json={"items": [
            {"request_id": "z", "generated_tokens": 0}]}).json()
        assert answer["drifted"] is True
        drift = client.get("/v1/calibration").json()["drift"]
        assert drift["drifted"] and drift["detector"] == "ks:output_length"
        assert drift["since"] is not None
        assert drift["streams"]["ks:output_length"]["since_sample"] == \
            SHIFT_DETECTION_INDEX


def test_window_detector_statistics():
    from predictor.calibration import WindowShiftDetector

    rng = np.random.default_rng(2)
    same = WindowShiftDetector("ks", reference=500, recent=100, check_every=10)
    assert not any(same.update(float(x)).drift_detected for x in rng.normal(size=5000))
    falling = WindowShiftDetector("mean_increase", reference=500, recent=100, min_effect=0.05)
    values = np.concatenate([rng.random(1000) * 0.4, rng.random(1000) * 0.1])
    assert not any(falling.update(float(x)).drift_detected for x in values)  # loss improved
    rising = WindowShiftDetector("mean_increase", reference=500, recent=100, min_effect=0.05)
    values = np.concatenate([rng.random(1000) * 0.1, rng.random(1000) * 0.4])
    hits = [i for i, x in enumerate(values) if rising.update(float(x)).drift_detected]
    assert hits and 1000 <= hits[0] <= 1100
    # a small reference is tested, with a threshold that accounts for both sample sizes
    small = WindowShiftDetector("ks", reference=3000, recent=300, min_effect=0.01)
    assert not any(small.update(float(x)).drift_detected for x in rng.normal(size=5000))
    assert small.last_threshold > 0.15  # the KS critical value at n = 3000, m = 300 rules
    with pytest.raises(ValueError):
        WindowShiftDetector("median")


def test_a_question_asked_again_is_scored_once(tmp_path):
    """A router asks about every active and waiting request at each refresh; a request still
    waiting (0 tokens) or unchanged is the same question again. Each (request, tokens,
    horizon) is recorded once, as ``balanceroute calibrate`` scores it, so waiting requests
    are not weighed by how long they waited."""
    from predictor.estimators import Features
    from predictor.service import PredictorService
    from predictor.store import make_engine

    url = f"sqlite:///{tmp_path / 'once.db'}"
    service = PredictorService(Settings(database_url=url, calibration_sample_rate=1.0),
                               make_engine(url))
    service.load()
    service.ingest([{"request_id": f"o{i}", "prompt_key": None, "prompt_tokens": 100,
                     "output_tokens": 10 + i, "finish_reason": "stop"}
                    for i in range(50)])
    ids = ["a", "b", "c"]
    for _ in range(4):  # four refreshes while a and b wait and c has generated 5 tokens
        service.record(ids, Features.of([0, 0, 5]), 20)
    assert service.tracker.pending_count == 3
    service.record(ids, Features.of([0, 2, 5]), 20)  # b was admitted and generated 2
    service.record(ids, Features.of([0, 2, 5]), 40)  # another horizon is another question
    assert service.tracker.pending_count == 3 + 1 + 3
    service.record(["d", "d"], Features.of([1, 1]), 20)  # twice in one query: once
    assert service.tracker.pending_count == 8
    scored = service.tracker.resolve("b", 30, False)
    assert sorted((s.generated, s.horizon) for s in scored if s.estimator == "survival") == [
        (0, 20), (2, 20), (2, 40)]
    service.engine.dispose()
