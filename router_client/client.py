"""The thin client a serving proxy embeds: mirrored state, BR-H with fallback, telemetry.

Wiring (SPEC.md section 7): the proxy calls :meth:`RouterClient.on_prefilled` when a prefill
finishes, relays each decode stream through :meth:`RouterClient.stream` (SSE telemetry
advances the request and ends it), reports client cancellations with
:meth:`RouterClient.on_cancel`, and calls :meth:`RouterClient.tick` once per decode step (or
whenever the pool is non-empty and a slot frees). ``tick`` refreshes predictions every
``refresh_steps`` ticks, expires stale entries, routes the pool with BR-H (BR-0 while the
predictor is unhealthy) and returns the dispatches to send; outcomes of ended requests are
handed to the predictor for reporting, which never blocks routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .admission import BalanceRouteParams
from .fallback import FallbackController, RouterMetrics
from .policies import BalanceRoutePolicy, Policy
from .predictors import ActiveBatch, FinishedBatch, Predictor, aged_c_hat
from .shadow import ShadowPolicy
from .sse import StreamTelemetry
from .state import MirroredFleet


@dataclass(frozen=True)
class RouterConfig:
    workers: int
    capacity: int
    params: BalanceRouteParams = BalanceRouteParams()
    refresh_steps: int = 10
    healthy_to_return: int = 3
    pool_ttl_s: float = 60.0
    active_ttl_s: float = 120.0


class RouterClient:
    def __init__(self, config: RouterConfig, predictor: Predictor | None = None,
                 shadows: list[Policy] | None = None,
                 metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self.predictor = predictor
        self.fleet = MirroredFleet(config.workers, config.capacity, config.pool_ttl_s,
                                   config.active_ttl_s)
        base: Policy = BalanceRoutePolicy("brh" if config.params.horizon else "br0",
                                          config.params)
        self.policy: Policy = ShadowPolicy(base, shadows) if shadows else base
        self.controller = FallbackController(config.healthy_to_return, metrics)
        self.steps = 0
        self.predictions: dict[str, tuple[float, int]] = {}  # request -> (c_hat, step)
        self.use_predictions = False
        self.fallback_rounds = 0

    # -- events from the proxy ------------------------------------------------------------
    def on_prefilled(self, request_id: str, prompt_tokens: int, now: float,
                     prompt_key: str | None = None) -> bool:
        return self.fleet.enqueue(request_id, prompt_tokens, now, prompt_key)

    def on_cancel(self, request_id: str, now: float) -> None:
        self.fleet.cancel(request_id, now)

    def stream(self, request_id: str) -> StreamTelemetry:
        """Telemetry for a dispatched request's SSE stream."""
        return StreamTelemetry(self.fleet, request_id)

    def reconcile(self, worker: int, engine_active: set[str], now: float) -> list[str]:
        return self.fleet.reconcile(worker, engine_active, now)

    # -- the decode-step loop -------------------------------------------------------------
    def tick(self, now: float) -> list[tuple[str, int]]:
        """One step: refresh if due, reap, route; returns (request_id, worker) dispatches."""
        step = self.steps
        self.steps += 1
        H = self.config.params.horizon
        if self.predictor is not None and H and step % self.config.refresh_steps == 0:
            self._refresh(step, H)
        self.fleet.reap(now)
        dispatches: list[tuple[str, int]] = []
        if self.fleet.pool:
            c_hat = self._aged(step, H) if self.use_predictions else None
            view, pool = self.fleet.view(c_hat, H)
            if H and c_hat is None:
                self.fallback_rounds += 1
            for assignment in self.policy.route(view, pool).assignments:
                request_id = str(pool[assignment.pool_index].request_id)
                if self.fleet.dispatch(request_id, assignment.worker, now):
                    dispatches.append((request_id, assignment.worker))
                    if request_id in self.predictions:  # predicted while waiting: its life
                        c, _ = self.predictions[request_id]  # starts now
                        self.predictions[request_id] = (c, step)
        self._report()
        return dispatches

    def _refresh(self, step: int, H: int) -> None:
        assert self.predictor is not None
        active = list(self.fleet.active.values())
        # Waiting requests are asked too (0 tokens generated), so that a request admitted
        # between refreshes has a prediction from its first step instead of the prior H.
        waiting = [entry.request for entry in self.fleet.pool.values()]
        ids = [r.request_id for r in active] + [str(w.request_id) for w in waiting]
        batch = ActiveBatch(
            np.asarray(ids, dtype=object),
            np.asarray([r.prompt_tokens for r in active] + [w.prompt_tokens for w in waiting],
                       dtype=np.int64),
            np.asarray([r.generated for r in active] + [0] * len(waiting), dtype=np.int64),
            [r.prompt_key for r in active] + [w.prompt_key for w in waiting],
        )
        prediction = self.predictor.predict(batch, H)
        healthy = prediction.c_hat is not None and not prediction.drifted
        reason = "ok" if healthy else ("drifted" if prediction.drifted else "unavailable")
        if healthy:
            assert prediction.c_hat is not None
            self.predictions = {request_id: (float(c), step)
                                for request_id, c in zip(ids, prediction.c_hat, strict=True)}
        self.use_predictions = self.controller.on_refresh(step, healthy, reason)

    def _aged(self, step: int, H: int) -> dict[str, float]:
        ids = list(self.predictions)
        answered = np.fromiter((self.predictions[r][0] for r in ids), np.float64, len(ids))
        at = np.fromiter((self.predictions[r][1] for r in ids), np.int64, len(ids))
        return dict(zip(ids, aged_c_hat(answered, step - at, H).tolist(), strict=True))

    def _report(self) -> None:
        outcomes = self.fleet.take_outcomes()
        for outcome in outcomes:
            self.predictions.pop(outcome["request_id"], None)
        if not outcomes or self.predictor is None:
            return
        self.predictor.observe(FinishedBatch(
            np.asarray([o["request_id"] for o in outcomes], dtype=object),
            np.asarray([o["prompt_tokens"] for o in outcomes], dtype=np.int64),
            np.asarray([o["output_tokens"] for o in outcomes], dtype=np.int64),
            np.asarray([o["finish_reason"] != "stop" for o in outcomes]),
            [o["prompt_key"] for o in outcomes],
            [o["finish_reason"] for o in outcomes],
        ))
