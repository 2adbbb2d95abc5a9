"""The proxy's non-blocking predictor: everything the service answers reaches the router
(``c_hat``, the two-point law, the recommendation), and the wait for the first answer at
start is neither a failure nor a fallback."""

from __future__ import annotations

import threading
import time

import numpy as np
from prometheus_client import generate_latest

from proxy.dispatcher import BackgroundPredictor, MaxTokensPredictor
from router_client.admission import BalanceRouteParams
from router_client.client import RouterClient, RouterConfig
from router_client.fallback import RouterMetrics
from router_client.predictors import ActiveBatch, FinishedBatch, Prediction
from router_client.projection import aged_law


class Gated:
    """Answers ``c_hat = 5 + index``, ``p_fin = 0.25``, ``mu_rem = 3`` and an advice, each
    query held until ``gate`` is set (a service slow to answer its first query)."""

    name = "gated"

    def __init__(self, advice: dict | None = None, fail: bool = False) -> None:
        self.gate = threading.Event()
        self.advice = advice
        self.fail = fail
        self.queries = 0

    def predict(self, batch: ActiveBatch, horizon: int) -> Prediction:
        self.gate.wait(10.0)
        self.queries += 1
        if self.fail:
            return Prediction(None)
        n = len(batch.request_ids)
        return Prediction(5.0 + np.arange(n, dtype=np.float64), recommendation=self.advice,
                          p_fin=np.full(n, 0.25), mu_rem=np.full(n, 3.0))

    def observe(self, finished) -> None:
        pass


def _batch(ids: list[str]) -> ActiveBatch:
    n = len(ids)
    return ActiveBatch(np.asarray(ids, dtype=object), np.full(n, 100, dtype=np.int64),
                       np.zeros(n, dtype=np.int64), [None] * n)


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_answer_keeps_the_law_and_the_advice_and_unseen_requests_get_the_prior():
    advice = {"policy": "brh", "horizon": 30, "beta": None, "gamma": 0.9,
              "estimator": "survival"}
    inner = Gated(advice)
    background = BackgroundPredictor(inner)
    try:
        first = background.predict(_batch(["a", "b"]), 20)
        assert first.c_hat is None and first.warming  # no answer yet: not a failure
        inner.gate.set()
        _until(lambda: inner.queries == 1 and not background.running)
        answer = background.predict(_batch(["b", "new", "a"]), 20)
        assert not answer.warming and not answer.drifted
        np.testing.assert_array_equal(answer.c_hat, [6.0, 20.0, 5.0])
        np.testing.assert_array_equal(answer.p_fin, [0.25, 0.0, 0.25])
        np.testing.assert_array_equal(answer.mu_rem, [3.0, 20.0, 3.0])
        assert answer.recommendation == advice
    finally:
        background.close()


def test_an_answer_one_refresh_old_is_aged_by_the_tokens_generated_since_it_was_asked():
    inner = Gated()
    inner.gate.set()
    background = BackgroundPredictor(inner)
    try:
        asked = ActiveBatch(np.asarray(["a", "b", "w"], dtype=object),
                            np.full(3, 100, dtype=np.int64), np.asarray([4, 0, 0]), [None] * 3)
        background.predict(asked, 20)  # answered later: c_hat 5, 6, 7; mu_rem 3
        _until(lambda: inner.queries == 1 and not background.running)
        # since then: a generated 3 more tokens, b none, the waiting w was admitted and made 6
        now = ActiveBatch(np.asarray(["a", "b", "w"], dtype=object),
                          np.full(3, 100, dtype=np.int64), np.asarray([7, 0, 6]), [None] * 3)
        answer = background.predict(now, 20)
        np.testing.assert_array_equal(answer.c_hat, [2.0, 6.0, 1.0])
        # the law conditioned on each request still running, as the router's cache ages it
        p_fin, mu_rem = aged_law(np.full(3, 0.25), np.full(3, 3.0), np.array([3, 0, 6]), 20)
        np.testing.assert_array_equal(answer.mu_rem, mu_rem)
        np.testing.assert_array_equal(answer.p_fin, p_fin)
        assert answer.p_fin[1] == 0.25 and answer.mu_rem[1] == 3.0  # b: nothing elapsed
        assert answer.p_fin[0] < 0.25 and answer.mu_rem[0] > 1.0  # a outlived much of it
    finally:
        background.close()
    # the aging before, on a predictor of its own: the refresh the call with ``now`` started
    # above may still count on ``inner`` (close does not wait for it), so a count there races
    inner = Gated()
    inner.gate.set()
    background = BackgroundPredictor(inner, end_shape="uniform")
    try:
        background.predict(asked, 20)
        _until(lambda: inner.queries == 1 and not background.running)
        answer = background.predict(now, 20)
        np.testing.assert_array_equal(answer.mu_rem, [1.0, 3.0, 1.0])
        np.testing.assert_array_equal(answer.p_fin, [0.25, 0.25, 0.25])
    finally:
        background.close()


def test_a_failed_first_query_is_a_failure_not_a_warm_up():
    inner = Gated(fail=True)
    background = BackgroundPredictor(inner)
    try:
        assert background.predict(_batch(["a"]), 20).warming
        inner.gate.set()
        _until(lambda: inner.queries == 1 and not background.running)
        answer = background.predict(_batch(["a"]), 20)
        assert answer.c_hat is None and not answer.warming
    finally:
        background.close()


def test_a_router_starting_before_the_first_answer_neither_falls_back_nor_counts_a_failure():
    advice = {"policy": "brh", "horizon": 40, "beta": 12.0, "gamma": 0.9,
              "estimator": "exact_match"}
    inner = Gated(advice)
    metrics = RouterMetrics()
    background = BackgroundPredictor(inner)
    router = RouterClient(RouterConfig(workers=2, capacity=4, refresh_steps=10), background,
                          metrics=metrics)
    try:
        router.on_prefilled("r0", 100, now=0.0)
        for step in range(5):  # the first query is held: routed as BR-0, asked every step
            router.tick(now=float(step))
        scraped = generate_latest(metrics.registry).decode()
        assert "balanceroute_router_brh_active 0.0" in scraped
        assert router.fallback_rounds >= 1 and router.adopted is None
        inner.gate.set()
        _until(lambda: inner.queries == 1 and not background.running)
        for step in range(5, 8):
            router.tick(now=float(step))
        assert router.use_predictions
        assert router.controller.switches == []  # no fallback logged at start
        scraped = generate_latest(metrics.registry).decode()
        assert "balanceroute_router_brh_active 1.0" in scraped
        assert "balanceroute_router_refresh_failures_total{" not in scraped
        # the service's advice reached the router through the background refresh
        assert router.adopted == advice and router.policy.params.horizon == 40
    finally:
        background.close()


def test_a_br0_router_never_shows_brh_active():
    metrics = RouterMetrics()
    router = RouterClient(RouterConfig(workers=2, capacity=4,
                                       params=BalanceRouteParams.br0()), None, metrics=metrics)
    router.on_prefilled("r0", 100, now=0.0)
    router.tick(now=0.0)
    assert "balanceroute_router_brh_active 0.0" in generate_latest(metrics.registry).decode()


def test_lengths_from_max_tokens_are_the_remaining_tokens_capped_at_h():
    lengths = MaxTokensPredictor()
    lengths.expect("a", 50)
    lengths.expect("b", 200)
    lengths.expect("c", True)  # not a count: ignored, as are missing and non-positive ones
    lengths.expect("d", 0)
    lengths.expect("gone", 30)  # left the pool without running: no outcome will come
    batch = ActiveBatch(np.asarray(["a", "b", "c", "d", "e"], dtype=object),
                        np.full(5, 100, dtype=np.int64), np.asarray([45, 10, 3, 0, 0]),
                        [None] * 5)
    answer = lengths.predict(batch, 80)
    np.testing.assert_array_equal(answer.c_hat, [5.0, 80.0, 80.0, 80.0, 80.0])
    assert set(lengths.limits) == {"a", "b"}  # what the router no longer holds is forgotten
    assert not answer.warming and not answer.drifted
    lengths.observe(FinishedBatch(np.asarray(["a"], dtype=object), np.asarray([100]),
                                  np.asarray([50]), np.asarray([False]), [None]))
    assert set(lengths.limits) == {"b"}
