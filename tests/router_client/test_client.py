"""The embeddable router client driven like a serving proxy would drive it."""

import json

import httpx
import numpy as np
import pytest

from predictor.livesrv import live_server
from router_client.admission import BalanceRouteParams
from router_client.client import RouterClient, RouterConfig
from router_client.fallback import BR0, BRH, FallbackController, RouterMetrics
from router_client.fleet import ArrivalRate
from router_client.http_predictor import HttpPredictor
from router_client.policies import make_policy


def chunk(content=None, finish=None, usage=None):
    body = {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": content} if content else {},
                         "finish_reason": finish}]}
    if usage:
        body = {"object": "chat.completion.chunk", "choices": [], "usage": usage}
    return f"data: {json.dumps(body)}\n\n".encode()


class FakeEngine:
    """Decode workers that stream one token per tick to every active request."""

    def __init__(self, rng, lengths):
        self.rng = rng
        self.lengths = lengths
        self.streams = {}  # request id -> [telemetry, tokens sent, fate]

    def start(self, client, request_id):
        fate = self.rng.choice(["finish", "finish", "finish", "finish", "cut", "cancel"])
        self.streams[request_id] = [client.stream(request_id), 0, fate]

    def step(self, client, now):
        for request_id, entry in list(self.streams.items()):
            telemetry, sent, fate = entry
            target = self.lengths[request_id]
            if fate == "cancel" and sent == target // 2:
                client.on_cancel(request_id, now)
                del self.streams[request_id]
                continue
            if fate == "cut" and sent == target // 2:
                telemetry.feed(b'data: {"choices": [{"delta": {"content": "x"}}]', now)
                telemetry.close(now)  # connection dropped mid-chunk
                del self.streams[request_id]
                continue
            entry[1] = sent + 1
            telemetry.feed(chunk("tok"), now)
            if entry[1] == target:
                telemetry.feed(chunk(finish="stop") + chunk(usage={"completion_tokens": target})
                               + b"data: [DONE]\n\n", now)
                telemetry.close(now)
                del self.streams[request_id]


def test_router_client_end_to_end_with_sse_and_a_live_service(tmp_path):
    rng = np.random.default_rng(0)
    n = 400
    lengths = {f"req-{i}": int(rng.integers(5, 60)) for i in range(n)}
    prompts = {f"req-{i}": int(rng.integers(50, 2000)) for i in range(n)}
    engine = FakeEngine(rng, lengths)
    config = RouterConfig(workers=4, capacity=8, params=BalanceRouteParams(horizon=40),
                          refresh_steps=5)
    with live_server(f"sqlite:///{tmp_path / 'client.db'}") as url:
        predictor = HttpPredictor(url, "auto")
        metrics = RouterMetrics()
        client = RouterClient(config, predictor, shadows=[make_policy("jsq")], metrics=metrics)
        arrivals = iter(sorted(lengths))
        pending = list(lengths)
        cancelled_in_pool = set()
        now = 0.0
        for tick in range(5000):
            now = tick * 0.05
            for _ in range(2):
                request_id = next(arrivals, None)
                if request_id is not None:
                    client.on_prefilled(request_id, prompts[request_id], now)
                    if rng.random() < 0.03:  # the client gives up while waiting
                        client.on_cancel(request_id, now)
                        cancelled_in_pool.add(request_id)
            for request_id, _worker in client.tick(now):
                engine.start(client, request_id)
            engine.step(client, now)
            client.fleet.check()
            if not client.fleet.pool and not client.fleet.active and tick > n:
                break
        predictor.close()
        status = httpx.get(url + "/v1/status").json()
    fleet = client.fleet
    assert not fleet.active and not fleet.pool, "every slot freed"
    assert all(request_id in fleet.ended for request_id in pending)
    reported = fleet.counters.dispatched  # every dispatched request ends with an outcome
    assert status["observations"] == reported == n - len(cancelled_in_pool)
    reasons = set(fleet.ended.values())
    assert {"stop", "error", "cancelled"} <= reasons
    assert client.controller.mode == BRH and client.controller.switches == []
    assert client.fallback_rounds <= 1  # at most the first round, before any refresh
    summary = client.policy.summary()
    assert set(summary) == {"brh", "jsq"}
    assert 'balanceroute_router_brh_active 1.0' in \
        __import__("prometheus_client").generate_latest(metrics.registry).decode()


def test_fallback_controller_does_not_flap_and_counts_switches():
    metrics = RouterMetrics()
    controller = FallbackController(healthy_to_return=3, metrics=metrics)
    outcomes = [True, False, True, True, False, True, True, True, True]
    modes = [controller.on_refresh(step, ok, "ok" if ok else "unavailable")
             for step, ok in enumerate(outcomes)]
    assert modes == [True, False, False, False, False, False, False, True, True]
    assert [(s.step, s.to) for s in controller.switches] == [(1, BR0), (7, BRH)]
    text = __import__("prometheus_client").generate_latest(metrics.registry).decode()
    assert 'balanceroute_router_fallback_switches_total{reason="unavailable",to="br0"} 1.0' \
        in text
    assert 'balanceroute_router_refresh_failures_total{reason="unavailable"} 2.0' in text


class SeenViews:
    """A BR-0 policy that keeps the arrival rate of every view it is given."""

    name, needs_predictions = "br0", False

    def __init__(self):
        self.inner = make_policy("br0")
        self.rates = []

    def route(self, fleet, pool):
        self.rates.append(fleet.arrival_rate)
        return self.inner.route(fleet, pool)


def test_router_client_measures_the_arrival_rate_it_routes_with():
    """Requests accepted into the pool per tick, averaged (the turnover discount reads it):
    3 in the first tick, none in the second -> 3, then (0.98 * 3 + 0) / (0.98 + 1)."""
    seen = SeenViews()
    client = RouterClient(RouterConfig(workers=2, capacity=1), policy=seen)
    for name in ("a", "b", "c"):
        assert client.on_prefilled(name, 100, now=0.0)
    assert not client.on_prefilled("a", 100, now=0.0)  # a repeat is not an arrival
    client.tick(0.0)  # two admitted, one left waiting (capacity 1 per worker)
    client.tick(0.1)
    assert seen.rates == [3.0, pytest.approx(0.98 * 3 / 1.98)]


class Constant:
    """A predictor that answers ``c_hat = 30`` for every request."""

    name = "constant"

    def predict(self, batch, horizon):
        from router_client.predictors import Prediction

        return Prediction(np.full(len(batch.request_ids), 30.0))

    def observe(self, finished):
        pass


class SeenCHat:
    """A BR-H policy that keeps the running requests' ``c_hat`` of every view."""

    name, needs_predictions = "brh", True

    def __init__(self):
        self.inner = make_policy("brh")
        self.c_hat = []
        self.rates = []

    def route(self, fleet, pool):
        self.c_hat.append(None if fleet.active_c_hat is None else fleet.active_c_hat.tolist())
        self.rates.append(fleet.arrival_rate)
        return self.inner.route(fleet, pool)


def test_router_client_ages_answers_by_the_tokens_streamed_not_by_its_rounds():
    """A proxy ticks when a slot frees, not once per decode step: between two ticks a request
    may stream many tokens, and its answer must age by them."""
    seen = SeenCHat()
    client = RouterClient(RouterConfig(workers=1, capacity=1, refresh_steps=100),
                          Constant(), policy=seen)
    for name in ("a", "b"):
        assert client.on_prefilled(name, 100, now=0.0)
    assert client.tick(0.0) == [("a", 0)]  # refreshed (both waiting, asked at 0 tokens)
    telemetry = client.stream("a")
    for _ in range(12):
        telemetry.feed(chunk("tok"), 0.05)
    assert client.tick(0.1) == []  # b still waits: one slot
    assert seen.c_hat[-1] == [18.0]  # 30 - 12 tokens, not 30 - 1 round
    # the arrival rate is per decode step too: 2 arrivals, then none over 12 steps
    expected = ArrivalRate()
    expected.add(2)
    expected.add(0, 12)
    assert seen.rates == [2.0, pytest.approx(expected.rate)]
    assert expected.rate < 0.98 * 2 / 1.98  # what counting the tick as one step gave


def test_adopting_a_recommendation_keeps_the_guards_wait_count():
    """A recommendation rebuilds the policy; the guard ``idle``'s count of rounds each worker
    has waited (what ``patience`` bounds) carries over, so a switch cannot restart a wait."""
    params = BalanceRouteParams(guard="idle", patience=3)
    client = RouterClient(RouterConfig(workers=2, capacity=4, params=params))
    first = client.base_policy
    first.waited = np.array([2, 0])
    for advice in ({"policy": "br0"}, {"policy": "brh", "horizon": 40, "gamma": 0.9}):
        assert client.adopt(advice)
        assert client.base_policy is not first and client.policy is client.base_policy
        assert client.base_policy.waited.tolist() == [2, 0]
        assert client.base_policy.params.patience == 3
