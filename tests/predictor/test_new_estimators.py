"""Shrunk ExactMatch, the hazard model, and the offline calibration command."""

import json
import os
import signal
import sys
import threading

import numpy as np
import pytest

from predictor.cli import main
from predictor.estimators import ExactMatchEstimator, Features, HazardEstimator, Outcomes
from predictor.estimators import hazard as hazard_module
from predictor.estimators.exact_match import estimate_prior_weight, length_bin
from predictor.estimators.fit_worker import FitProcess, FitProcessError
from predictor.estimators.hazard import Curves, bin_edges, person_period, reset_fit_process
from predictor.estimators.km import KaplanMeier, residual_life


def test_shrinkage_is_the_global_curve_at_n_zero_and_the_bucket_as_n_grows():
    rng = np.random.default_rng(0)
    others = rng.integers(1, 300, 400)
    generated = np.array([0, 5, 11])  # within the key's lengths (past them the global
    # part of the blend answers alone: a request outlived all the key's observations)
    for n, tolerance in [(1, None), (20000, 0.05)]:
        est = ExactMatchEstimator(window=0, bucket_window=n, prior_weight=4.0,
                                  estimate_weight=False)
        est.partial_fit(Outcomes.of(others))
        est.partial_fit(Outcomes.of(np.full(n, 12), prompt_key=["k"] * n))
        answer = est.predict(Features.of(generated, ["k"] * 3), 40)
        unseen = est.predict(Features.of(generated, ["never"] * 3), 40)
        key = residual_life(KaplanMeier().fit(np.full(n, 12), np.ones(n, bool)).survival_,
                            generated, 40)
        glob = residual_life(est.fallback_.curve_.survival_, generated, 40)
        np.testing.assert_allclose(unseen.c_hat, glob.c_hat)  # n = 0: the global curve
        if tolerance is not None:  # n -> inf: the bucket
            np.testing.assert_allclose(answer.c_hat, key.c_hat, atol=tolerance)
        else:  # n = 1, k = 4: one part bucket, four parts global, on the curve
            survival = (1 * KaplanMeier().fit([12], [True]).survival_at(np.arange(400))
                        + 4 * est.fallback_.curve_.survival_at(np.arange(400))) / 5
            np.testing.assert_allclose(answer.c_hat, residual_life(survival, generated, 40).c_hat)


def _urn_sequences(k, keys, per_key, rng):
    """Blackwell-MacQueen urn: each key's lengths are a draw from DP(k, lognormal)."""
    out = []
    for _ in range(keys):
        seq = []
        for i in range(per_key):
            if rng.random() < k / (k + i):
                seq.append(int(length_bin(np.array([rng.lognormal(5, 1)]))[0]))
            else:
                seq.append(seq[rng.integers(0, i)])
        out.append(seq)
    return out


def test_empirical_bayes_weight_recovers_the_dirichlet_concentration():
    rng = np.random.default_rng(1)
    for k in (0.5, 5.0, 50.0):
        estimate = estimate_prior_weight(_urn_sequences(k, 300, 8, rng))
        assert estimate is not None and k / 2 < estimate < k * 2
    assert estimate_prior_weight([[3]] * 50) is None  # no repeated keys yet
    assert estimate_prior_weight(_urn_sequences(1e6, 300, 8, rng)) > 100


def test_person_period_rows():
    edges = bin_edges(1)  # 0, 1, 2, 4, 8, ...
    owner, bins, target, weight = person_period(np.array([5, 5, 7, 4]),
                                                np.array([True, False, False, False]), edges)
    # ended at 5 (bin [4, 8)): bins 0..3, ends in 3; censored at 5: survived bins 0..2 and
    # tokens 4 and 5 of bin 3's four (weight 2/4); censored at 7: bins 0..3 whole; censored
    # at 4: bins 0..2 and one token of bin 3 (1/4)
    assert owner.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert bins.tolist() == [0, 1, 2, 3] * 4
    assert target.tolist() == [False, False, False, True] + [False] * 12
    assert weight.tolist() == [1, 1, 1, 1, 1, 1, 1, 0.5, 1, 1, 1, 1, 1, 1, 1, 0.25]


def test_hazard_curves_window_area_is_exact_far_out():
    """The window's area ``sum_{h<H} S(a+h)`` against a direct sum of the curve (log space,
    in fractions of S(a)), near the start and a million tokens out, where the curve is
    ~1e-20: it lies in [S(a), H S(a)] (its first term is S(a)), so ``c_hat`` in [1, H]."""
    edges = bin_edges(3)
    hazard = np.full((2, edges.size), 0.3)
    hazard[0, :12] = 0.9  # a curve that falls fast, then slowly
    curves = Curves(hazard, edges, edges.size)
    group = np.array([0, 0, 0, 0, 1, 1])
    generated = np.array([0, 10, 500_000, 1_048_575, 3, 700_000])
    for horizon in (1, 80, 4096):
        s_now, s_end, area = curves.terms(group, generated, horizon)
        for i, (g, a) in enumerate(zip(group, generated, strict=True)):
            t = np.arange(a, a + horizon + 1)
            b = np.searchsorted(edges, t, side="right") - 1
            log_s = curves.log_start[g, b] + (t - edges[b] + 1) * curves.log_rate[g, b]
            relative = np.exp(log_s - log_s[0])  # S(a + h) / S(a), h = 0..H
            assert s_now[i] == pytest.approx(np.exp(log_s[0]), rel=1e-12)
            assert s_end[i] / s_now[i] == pytest.approx(relative[-1], rel=1e-9)
            assert area[i] / s_now[i] == pytest.approx(relative[:-1].sum(), rel=1e-9)


def _hazard(**kwargs):
    return HazardEstimator(window=4000, refit_every=4000, min_fit=100, max_iter=40, **kwargs)


def test_hazard_without_features_matches_kaplan_meier_with_censoring():
    rng = np.random.default_rng(2)
    lengths = np.maximum(1, rng.lognormal(4.5, 0.9, 3000).astype(int))
    censor_at = rng.integers(1, 400, 3000)
    censored = censor_at < lengths
    observed = np.minimum(lengths, censor_at)
    est = _hazard().partial_fit(Outcomes.of(observed, censored))
    km = KaplanMeier().fit(observed, ~censored)
    generated = np.array([0, 20, 60, 120, 200])
    answer = est.predict(Features.of(generated), 80)
    want = residual_life(km.survival_, generated, 80)
    assert est.n_fits_ == 1 and answer.source == ["hazard"] * 5
    # within 0.03 where the curve is well supported; at 200 (bins of about 50 and 66 tokens,
    # at risk 400-800) the bins' actuarial hazards (a request censored inside a bin at risk
    # for the share of it it lived through) give 0.04 less than Kaplan-Meier's exact steps
    np.testing.assert_allclose(answer.p_fin[:4], want.p_fin[:4], atol=0.03)
    assert answer.p_fin[4] == pytest.approx(want.p_fin[4], abs=0.05)
    np.testing.assert_allclose(answer.c_hat, want.c_hat, atol=3.0)
    # censoring does not bias it toward short lengths: dropping the censored ones would
    naive = KaplanMeier().fit(observed[~censored], np.ones((~censored).sum(), bool))
    biased = residual_life(naive.survival_, generated, 80)
    assert (biased.p_fin[1:] - answer.p_fin[1:]).min() > 0.03


def test_hazard_learns_a_prompt_length_dependence():
    rng = np.random.default_rng(3)
    prompts = rng.integers(100, 4000, 3000)
    lengths = np.maximum(1, (prompts / 10 * rng.lognormal(0, 0.2, 3000)).astype(int))
    est = _hazard().partial_fit(Outcomes.of(lengths, prompt_tokens=prompts))
    answer = est.predict(Features.of([0, 0], prompt_tokens=[300, 3000]), 80)
    # prompt 300 -> about 30 tokens: ends within 80; prompt 3000 -> about 300: does not
    assert answer.p_fin[0] > 0.9 and answer.p_fin[1] < 0.1
    assert answer.c_hat[0] == pytest.approx(30, abs=8) and answer.c_hat[1] > 75


def test_hazard_uses_key_statistics_and_is_deterministic():
    rng = np.random.default_rng(4)
    keys = rng.integers(0, 40, 3000)
    centres = np.exp(rng.uniform(2, 6, 40))
    lengths = np.maximum(1, (centres[keys] * rng.lognormal(0, 0.2, 3000)).astype(int))
    outcomes = Outcomes.of(lengths, prompt_key=[f"k{k}" for k in keys])
    a, b = _hazard().partial_fit(outcomes), _hazard().partial_fit(outcomes)
    short, long_ = int(np.argmin(centres)), int(np.argmax(centres))
    features = Features.of([0, 0, 0], [f"k{short}", f"k{long_}", "new"])
    first, second = a.predict(features, 80), b.predict(features, 80)
    np.testing.assert_array_equal(first.c_hat, second.c_hat)
    assert first.c_hat[0] < 20 and first.c_hat[1] > 75 and 20 < first.c_hat[2] < 75
    np.testing.assert_array_equal(first.c_hat, a.predict(features, 80).c_hat)  # cached


def test_hazard_key_curves_answer_a_known_key_with_its_own_lengths():
    """A key whose outputs always have the same length, among keys that vary widely: with
    key curves the model's curve is shrunk toward the key's own (n / (n + k) of it), so the
    key's requests are predicted to end at that length; an unknown key gets the model alone."""
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 100, 3000)
    centres = np.exp(rng.uniform(2, 6, 100))  # keys that carry signal: k is estimated low
    lengths = np.maximum(1, (centres[keys] * rng.lognormal(0, 0.3, 3000)).astype(int))
    lengths[keys == 0] = 10  # key k0: exactly 10 tokens, every time
    outcomes = Outcomes.of(lengths, prompt_key=[f"k{k}" for k in keys])
    keyed = _hazard().partial_fit(outcomes)
    plain = _hazard(key_curves=False).partial_fit(outcomes)
    features = Features.of([0, 0, 5], ["k0", "new", "k0"])
    got, model = keyed.predict(features, 80), plain.predict(features, 80)
    n, k = keyed.keyed_.buckets_["k0"].n_observed, keyed.keyed_.prior_weight_
    assert n == int((keys == 0).sum()) and n / (n + k) > 0.8
    assert got.c_hat[0] == pytest.approx(10, abs=0.2 * model.c_hat[0])
    assert abs(got.c_hat[0] - 10) < abs(model.c_hat[0] - 10)
    assert got.p_fin[0] > 0.95
    assert got.c_hat[2] == pytest.approx(5, abs=0.2 * model.c_hat[2])  # 5 more tokens
    np.testing.assert_allclose(got.c_hat[1], model.c_hat[1], rtol=1e-12)
    np.testing.assert_allclose(got.p_fin[1], model.p_fin[1], rtol=1e-12)
    assert got.source == ["hazard"] * 3


def test_hazard_answers_survival_before_its_first_fit():
    est = HazardEstimator(min_fit=50)
    assert est.predict(Features.of([0]), 80).source == ["prior"]
    est.partial_fit(Outcomes.of(np.arange(1, 30)))
    assert est.model_ is None and est.predict(Features.of([0]), 80).source == ["survival"]


def test_calibrate_command_runs_on_a_small_synthetic_trace(tmp_path, capsys):
    out = tmp_path / "cal.json"
    code = main(["calibrate", "--trace", "synth:templated:n=400,templates=8", "--workers", "2",
                 "--batch", "16", "--horizon", "40", "--sample-rate", "0.3",
                 "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["estimators"]
    assert [r["estimator"] for r in rows] == ["survival", "exact_match", "hazard"]
    assert all(r["scored"] > 100 and 0 <= r["brier"] <= 1 for r in rows)
    assert "hazard" in printed and "brier" in printed


def test_hazard_learns_from_the_requests_still_running():
    """A young service has seen the short requests end while the long ones still run. Fit on
    the finished ones alone, the model's chance of ending within the window is far too high
    (+0.10 to +0.45 here); with the running ones as censored rows (``observe_running``, as
    the router's queries give them) it matches the truth, and the global mean that drifts
    while they come in (short ones first) is not a feature that tells the two kinds of row
    apart."""
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(4.8, 1.0, 6000).astype(int))
    start = rng.uniform(0, 600, 6000)
    done = start + lengths <= 600
    running = (600 - start[~done]).astype(int)
    order = np.argsort((start + lengths)[done])  # in the order they finished
    finished = Outcomes.of(lengths[done][order])
    ages = np.array([10, 50, 100, 200, 300, 500])
    truth = np.array([(lengths[lengths > a] <= a + 80).mean() for a in ages])
    est = _hazard().observe_running(Features.of(running)).partial_fit(finished)
    np.testing.assert_allclose(est.predict(Features.of(ages), 80).p_fin, truth, atol=0.03)
    blind = _hazard().partial_fit(finished)
    assert (blind.predict(Features.of(ages), 80).p_fin - truth).min() > 0.09
    # what the model counts as observed stays the finished ones (its window's 4,000)
    assert est.n_fitted_ == blind.n_fitted_ == min(int(done.sum()), 4000)


def test_hazard_fits_in_a_process_of_their_own_give_the_same_model():
    """``fit_in_subprocess`` (the service's default, ``hazard_fit_process``) fits the booster
    in a worker process (:mod:`predictor.estimators.fit_worker`): the same answers, to the
    bit, as the fits on this thread, over several fits (deferred as a service defers them).
    A worker that died is replaced at the next fit; a fit the worker cannot do falls back to
    this thread."""
    rng = np.random.default_rng(6)
    keys = rng.integers(0, 40, 2400)
    centres = np.exp(rng.uniform(2, 6, 40))
    lengths = np.maximum(1, (centres[keys] * rng.lognormal(0, 0.3, 2400)).astype(int))
    prompts = rng.integers(100, 4000, 2400)
    features = Features.of([0, 0, 7], ["k1", "k2", "new"], prompt_tokens=[300, 900, 2000])
    lock = threading.RLock()

    def fitted(in_process: bool) -> HazardEstimator:
        est = HazardEstimator(window=4000, refit_every=600, min_fit=100, max_iter=40)
        est.fit_in_subprocess = in_process
        est.defer_fits = True
        for start in range(0, 2400, 600):
            part = slice(start, start + 600)
            est.partial_fit(Outcomes.of(lengths[part], prompt_key=[f"k{k}" for k in keys[part]],
                                        prompt_tokens=prompts[part]))
            assert est.fit_deferred(lock)
        assert est.n_fits_ == 4
        return est

    reset_fit_process()
    here = fitted(False).predict(features, 80)
    assert hazard_module._fit_process is None  # no worker for fits on this thread
    answers = [fitted(True).predict(features, 80)]
    worker = hazard_module.fit_process()
    first = worker.pid
    assert first is not None and first != os.getpid()
    os.kill(first, signal.SIGKILL)  # a worker gone: the next fit starts another
    answers.append(fitted(True).predict(features, 80))
    assert worker.pid not in (None, first)
    for answer in answers:
        np.testing.assert_array_equal(answer.c_hat, here.c_hat)
        np.testing.assert_array_equal(answer.p_fin, here.p_fin)
    with pytest.raises(FitProcessError, match="the fit failed in the fit process"):
        worker.call(None, None, {})  # a snapshot the worker cannot fit: reported, not fatal
    est = HazardEstimator(min_fit=50, max_iter=5)
    est.fit_in_subprocess = True
    est.max_iter = -1  # the booster rejects it in the worker, and on this thread
    with pytest.raises(ValueError, match="max_iter"):
        est.partial_fit(Outcomes.of(lengths[:200], prompt_tokens=prompts[:200]))
    reset_fit_process()


def test_a_fit_worker_that_does_not_answer_is_stopped():
    """A worker that hangs (here one that never reads its frames) is killed after
    ``timeout_s``, the request's sending included (a snapshot of 800 KB does not fit in a
    pipe's buffer), and reported as :class:`FitProcessError`, on which the estimator fits on
    its own thread; the next call starts a new worker. After three failures in a row the
    process is given up: calls fail at once, without starting one."""
    hung = FitProcess(timeout_s=0.5, command=[sys.executable, "-c",
                                              "import time; time.sleep(60)"])
    with pytest.raises(FitProcessError, match="no answer within 0.5 s"):
        hung.call(np.zeros(100_000), None, {})
    assert hung.pid is None  # stopped
    with pytest.raises(FitProcessError, match="no answer"):
        hung.call(None, None, {})  # a new worker, which hangs as well
    assert hung.failures == 2
    gone = FitProcess(timeout_s=5, command=[sys.executable, "-c", "pass"])  # exits at once
    for _ in range(FitProcess.MAX_FAILURES):
        with pytest.raises(FitProcessError, match="failed"):
            gone.call(np.zeros(100_000), None, {})
    assert gone.given_up
    with pytest.raises(FitProcessError, match="given up"):
        gone.call(None, None, {})
    assert gone.pid is None


def test_the_service_fits_the_hazard_model_where_its_setting_says(tmp_path):
    """``HAZARD_FIT_PROCESS`` (default true) reaches the service's hazard estimator; the
    estimator alone (the simulator, offline runs) fits on its own thread."""
    from predictor.service import PredictorService
    from predictor.settings import Settings
    from predictor.store import make_engine

    assert HazardEstimator().fit_in_subprocess is False
    for setting in (True, False):
        url = f"sqlite:///{tmp_path / f'{setting}.db'}"
        service = PredictorService(Settings(database_url=url, hazard_fit_process=setting),
                                   make_engine(url))
        assert service.estimators["hazard"].fit_in_subprocess is setting
        service.engine.dispose()
    assert Settings(database_url="sqlite://").hazard_fit_process is True
