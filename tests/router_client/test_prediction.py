"""The prediction path shared by the simulator and RouterClient (PredictionCache)."""

import numpy as np
import pytest

from router_client.prediction import PredictionCache
from router_client.predictors import ActiveBatch, Prediction


class Scripted:
    """Answers from a script: a list of c_hat arrays, or None (unavailable) or 'drift'."""

    name = "scripted"

    def __init__(self, answers):
        self.answers = list(answers)
        self.asked = []

    def predict(self, batch, horizon):
        self.asked.append(list(batch.request_ids))
        answer = self.answers.pop(0)
        if answer is None:
            return Prediction(None)
        if isinstance(answer, str):
            return Prediction(np.full(len(batch.request_ids), 5.0), drifted=True)
        return Prediction(np.asarray(answer, dtype=float))

    def observe(self, finished):
        pass


def batch(ids, generated=None):
    n = len(ids)
    return ActiveBatch(np.asarray(ids, dtype=object), np.full(n, 100),
                       np.asarray(generated if generated is not None else [0] * n),
                       [None] * n)


def test_refresh_schedule_every_refresh_steps():
    cache = PredictionCache(Scripted([]), horizon=80, refresh_steps=10)
    assert cache.due(0)
    cache.last_refresh = 0
    assert not cache.due(9) and cache.due(10) and cache.due(23)


def test_given_token_counts_a_refresh_is_due_after_refresh_steps_decode_steps():
    cache = PredictionCache(Scripted([[30.0, 30.0]]), horizon=80, refresh_steps=10)
    cache.refresh(0, batch(["a", "b"], [5, 0]), n_active=1)  # b was waiting
    assert not cache.due(3, ["a", "b"], [14, 40])  # a: 9 tokens since; b was not running
    assert cache.due(3, ["b", "a"], [40, 15])  # a: 10 tokens since, in 3 rounds
    assert not cache.due(3, ["b"], [40]) and not cache.due(3)  # rounds alone: 3 of 10
    assert cache.due(10, ["b"], [40])


def test_aging_cap_floor_and_unknown_requests():
    cache = PredictionCache(Scripted([[30.0, 80.0, 2.0]]), horizon=80)
    cache.refresh(0, batch(["a", "b", "c"], [5, 5, 5]), n_active=3)
    got = cache.c_hat_for(["a", "b", "c", "new"], step=4)
    # a: 30 - 4; b: at the cap H stays H; c: floored at 1; unknown: the prior H
    np.testing.assert_array_equal(got, [26.0, 80.0, 1.0, 80.0])


def test_with_token_counts_answers_age_by_the_tokens_generated_not_the_rounds():
    # A proxy routes when a slot frees, several decode steps apart: its rounds (``step``)
    # are not decode steps; the requests' own token counts are.
    cache = PredictionCache(Scripted([[30.0, 80.0, 2.0, 40.0]]), horizon=80)
    cache.refresh(0, batch(["a", "b", "c", "wait"], [5, 5, 5, 0]), n_active=3)
    cache.on_admit("wait", step=1)
    # two rounds later: a generated 12 more tokens, c 3, the admitted one 9; "new" has no answer
    got = cache.c_hat_for(["a", "b", "c", "wait", "new"], step=2,
                          generated=[17, 17, 8, 9, 4])
    np.testing.assert_array_equal(got, [18.0, 80.0, 1.0, 31.0, 80.0])
    # without the counts the rounds age them (the simulator's steps, where they coincide)
    np.testing.assert_array_equal(cache.c_hat_for(["a", "wait"], step=2), [28.0, 39.0])
    with pytest.raises(ValueError, match="one count per running request"):
        cache.c_hat_for(["a", "b"], step=2, generated=[1])


def test_a_waiting_request_ages_from_its_admission():
    cache = PredictionCache(Scripted([[20.0, 40.0]]), horizon=80)
    cache.refresh(0, batch(["run", "wait"], [3, 0]), n_active=1)
    cache.on_admit("wait", step=7)
    np.testing.assert_array_equal(cache.c_hat_for(["run", "wait"], step=9), [11.0, 38.0])
    cache.forget(["wait"])
    np.testing.assert_array_equal(cache.c_hat_for(["wait"], step=9), [80.0])


def test_unhealthy_refresh_falls_back_and_healthy_ones_return():
    answers = [[10.0], None, [10.0], "drift", [10.0], [10.0], [10.0]]
    cache = PredictionCache(Scripted(answers), horizon=80, refresh_steps=1)
    modes = []
    for step in range(len(answers)):
        refresh = cache.refresh(step, batch(["a"], [1]), n_active=1)
        modes.append((refresh.reason, cache.c_hat_for(["a"], step) is not None))
    assert modes == [("ok", True), ("unavailable", False), ("ok", False), ("drifted", False),
                     ("ok", False), ("ok", False), ("ok", True)]
    assert cache.fallback_rounds == 5
    assert [s.to for s in cache.controller.switches] == ["br0", "brh"]


def test_no_predictor_means_br0_and_no_refresh():
    cache = PredictionCache(None, horizon=80)
    assert not cache.due(0)
    assert cache.c_hat_for(["a"], 0) is None and cache.fallback_rounds == 1
    with pytest.raises(ValueError):
        cache.refresh(0, batch(["a"]), 1)


def test_annotate_gives_brh_everything_or_nothing():
    from router_client.fleet import FleetView

    view = FleetView.from_active(2, 4, np.array([0, 1]), np.array([100.0, 200.0]))
    cache = PredictionCache(Scripted([None, [30.0, 80.0, 12.0]]), horizon=80, refresh_steps=1)
    cache.refresh(0, batch(["a", "b", "w"], [2, 2, 0]), n_active=2)
    assert cache.annotate(view, ["a", "b"], ["w"], 0) is view  # unavailable: BR-0, untouched
    for step in range(1, 4):  # three healthy refreshes bring BR-H back
        if step > 1:
            cache.predictor.answers.append([30.0, 80.0, 12.0])
        cache.refresh(step, batch(["a", "b", "w"], [2, 2, 0]), n_active=2)
    got = cache.annotate(view, ["a", "b"], ["w", "new"], 5)
    np.testing.assert_array_equal(got.active_c_hat, [28.0, 80.0])
    np.testing.assert_array_equal(got.pool_c_hat[:1], [12.0])
    assert np.isnan(got.pool_c_hat[1]) and got.active_p_fin is None


def test_a_predictor_warming_again_after_an_answer_leaves_the_gauge_at_zero():
    """``balanceroute_router_brh_active`` follows whether predictions are used: a predictor
    that answered and then reports it is warming (no answer yet, not a failure) leaves it 0,
    with no fallback switch."""
    from prometheus_client import generate_latest

    from router_client.fallback import FallbackController, RouterMetrics

    class Warming(Scripted):
        def predict(self, batch, horizon):
            if self.answers and self.answers[0] == "warming":
                self.answers.pop(0)
                return Prediction(None, warming=True)
            return super().predict(batch, horizon)

    metrics = RouterMetrics()
    cache = PredictionCache(Warming([[5.0], "warming"]), horizon=80, refresh_steps=1,
                            controller=FallbackController(metrics=metrics))

    def gauge() -> str:
        return next(line for line in generate_latest(metrics.registry).decode().splitlines()
                    if line.startswith("balanceroute_router_brh_active "))

    cache.refresh(0, batch(["a"]), 1)
    assert cache.use_predictions and gauge().endswith(" 1.0")
    cache.refresh(1, batch(["a"]), 1)
    assert not cache.use_predictions and gauge().endswith(" 0.0")
    assert cache.controller.switches == []


class LawAnswer:
    """Answers c_hat with the law (p_fin 0.9, mu_rem 3) for every request asked about."""

    name = "law"

    def predict(self, batch, horizon):
        n = len(batch.request_ids)
        return Prediction(np.full(n, 0.1 * horizon + 0.9 * 3.0), p_fin=np.full(n, 0.9),
                          mu_rem=np.full(n, 3.0))

    def observe(self, finished):
        pass


@pytest.mark.parametrize("shape", ["exponential", "uniform"])
def test_annotate_ages_the_law_by_the_tokens_since_the_answer(shape):
    """A request 5 tokens past an answer that expected it to end within about 3 steps with
    chance 0.9: by default the law is conditioned on its still running (aged_law: a smaller
    p_fin, a later mean end than 3 - 5); with the uniform option, p_fin 0.9 kept and mu_rem
    floored at 1 (the aging before 2026-12-06). An answer just given is read as given."""
    from router_client.fleet import FleetView
    from router_client.projection import aged_law

    view = FleetView.from_active(2, 4, np.array([0, 1]), np.array([100.0, 200.0]))
    cache = PredictionCache(LawAnswer(), horizon=80, refresh_steps=1, end_shape=shape)
    for step in range(3):  # healthy refreshes bring BR-H in
        cache.refresh(step, batch(["a", "b"], [10, 20]), n_active=2)
    got = cache.annotate(view, ["a", "b"], [], 3, np.array([15, 20]))
    p_fin, mu_rem = aged_law(np.full(2, 0.9), np.full(2, 3.0), np.array([5, 0]), 80, shape)
    np.testing.assert_allclose(got.active_p_fin, p_fin)
    np.testing.assert_allclose(got.active_mu_rem, mu_rem)
    assert got.active_p_fin[1] == 0.9 and got.active_mu_rem[1] == 3.0
    if shape == "uniform":
        assert got.active_p_fin[0] == 0.9 and got.active_mu_rem[0] == 1.0
    else:
        assert got.active_p_fin[0] < 0.7 and got.active_mu_rem[0] > 8.0  # 0.68, 8.4
