"""The thin client a serving proxy embeds: mirrored state, BR-H with fallback, telemetry.

Wiring (the paper's serving proxy): the proxy calls :meth:`RouterClient.on_prefilled` when a prefill
finishes, relays each decode stream through :meth:`RouterClient.stream` (SSE telemetry
advances the request and ends it), reports client cancellations with
:meth:`RouterClient.on_cancel`, and calls :meth:`RouterClient.tick` once per decode step (or
whenever the pool is non-empty and a slot frees). ``tick`` refreshes predictions every
``refresh_steps`` ticks, expires stale entries, routes the pool with BR-H (BR-0 while the
predictor is unhealthy) and returns the dispatches to send; outcomes of ended requests are
handed to the predictor for reporting, which never blocks routing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from .admission import BalanceRouteParams, gamma_value
from .errors import ParameterError
from .fallback import FallbackController, RouterMetrics
from .fleet import ArrivalRate
from .policies import BalanceRoutePolicy, Policy, make_policy
from .prediction import PredictionCache
from .predictors import ActiveBatch, FinishedBatch, Predictor
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
    follow_recommendation: bool = True


log = logging.getLogger("balanceroute.router")


class RouterClient:
    """Mirrored fleet state, the prediction cache and a policy, driven by a proxy's events.

    The policy is BR-H with ``config.params`` (BR-0 when its horizon is 0) unless ``policy``
    is given (any registered policy, e.g. ``make_policy("jsq")``); ``shadows`` are routed on the
    same view for comparison only; ``wrap`` (optional) wraps the BR policy, now and whenever it
    is rebuilt (a proxy masks ranks that are down with it).

    Recommendations: when the predictor's answer carries the service's advice (``balanceroute
    tune``, ``POST /v1/tunings``) and ``config.follow_recommendation`` is set, the client adopts
    it at that refresh: BR-0, or BR-H with the advised H, beta and gamma. A workload where
    lookahead cannot help then runs BR-0. A client given its own ``policy`` keeps it.
    """

    def __init__(self, config: RouterConfig, predictor: Predictor | None = None,
                 shadows: list[Policy] | None = None,
                 metrics: RouterMetrics | None = None, policy: Policy | None = None,
                 wrap: Callable[[Policy], Policy] | None = None) -> None:
        self.config = config
        self.predictor = predictor
        self.fleet = MirroredFleet(config.workers, config.capacity, config.pool_ttl_s,
                                   config.active_ttl_s)
        self.shadows = shadows
        self.wrap = wrap
        self.owns_policy = policy is None
        self.params = config.params
        self.adopted: dict | None = None
        base = policy or make_policy("brh" if config.params.horizon else "br0",
                                     params=config.params)
        self.base_policy: Policy = base  # the policy before the wrap and the shadows
        self.policy: Policy = self._install(base)
        horizon = config.params.horizon if base.needs_predictions else 0
        self.predictions = PredictionCache(
            predictor, horizon, config.refresh_steps,
            FallbackController(config.healthy_to_return, metrics), config.params.end_shape)
        self.steps = 0
        self.arrivals = ArrivalRate()  # requests entering the pool per step (BR-H's turnover)
        self._arrived = 0
        self._tokens_at_tick: dict[str, int] = {}  # running requests' tokens at the last tick

    @property
    def controller(self) -> FallbackController:
        return self.predictions.controller

    @property
    def use_predictions(self) -> bool:
        """Whether BR-H routes with predictions now: the predictor healthy, and the policy
        one that reads them (not BR-0 adopted on the service's recommendation)."""
        return self.predictions.use_predictions and self.base_policy.needs_predictions

    @property
    def fallback_rounds(self) -> int:
        return self.predictions.fallback_rounds

    # -- events from the proxy ------------------------------------------------------------
    def on_prefilled(self, request_id: str, prompt_tokens: int, now: float,
                     prompt_key: str | None = None) -> bool:
        accepted = self.fleet.enqueue(request_id, prompt_tokens, now, prompt_key)
        self._arrived += int(accepted)
        return accepted

    def on_cancel(self, request_id: str, now: float) -> None:
        self.fleet.cancel(request_id, now)

    def stream(self, request_id: str, fixed_length: bool = False) -> StreamTelemetry:
        """Telemetry for a dispatched request's SSE stream; ``fixed_length``: the client asked
        for exactly ``max_tokens`` tokens (``ignore_eos``), see :class:`StreamTelemetry`."""
        return StreamTelemetry(self.fleet, request_id, fixed_length=fixed_length)

    def reconcile(self, worker: int, engine_active: set[str], now: float) -> list[str]:
        return self.fleet.reconcile(worker, engine_active, now)

    # -- the decode-step loop -------------------------------------------------------------
    def tick(self, now: float) -> list[tuple[str, int]]:
        """One step: refresh if due, reap, route; returns (request_id, worker) dispatches."""
        step = self.steps
        self.steps += 1
        decode_steps = 1
        if self.predictions.enabled:
            running, generated = self._running_tokens()
            decode_steps = self._decode_steps(running, generated)
            if self.predictions.due(step, running, generated):
                self._refresh(step)
        self.fleet.reap(now)
        self.arrivals.add(self._arrived, decode_steps)
        self._arrived = 0
        dispatches: list[tuple[str, int]] = []
        if self.fleet.pool:
            view, pool = self.fleet.view()
            view = replace(view, arrival_rate=self.arrivals.rate)
            if self.policy.needs_predictions:
                # again: the reap above may have ended some of them
                running, generated = self._running_tokens()
                view = self.predictions.annotate(view, running, [r.request_id for r in pool],
                                                 step, generated)
            for assignment in self.policy.route(view, pool).assignments:
                request_id = str(pool[assignment.pool_index].request_id)
                if self.fleet.dispatch(request_id, assignment.worker, now):
                    dispatches.append((request_id, assignment.worker))
                    self.predictions.on_admit(request_id, step)
        self._report()
        return dispatches

    def _running_tokens(self) -> tuple[list[str], np.ndarray]:
        """The running requests' ids and tokens generated so far, in the fleet's order."""
        active = self.fleet.active
        return list(active), np.fromiter((r.generated for r in active.values()), np.int64,
                                         len(active))

    def _decode_steps(self, running: list[str], generated: np.ndarray) -> int:
        """Decode steps since the last tick, for the arrival rate (per step, as BR-H's turnover
        reads it): the most tokens a running request generated in between (one not running
        at the last tick was dispatched by it, at 0 tokens). A proxy ticks when a slot frees,
        often several steps apart, or twice within one; 1 (a tick) with none running."""
        before = self._tokens_at_tick
        self._tokens_at_tick = dict(zip(running, generated.tolist(), strict=True))
        steps = max((g - before.get(r, 0) for r, g in self._tokens_at_tick.items()),
                    default=None)
        return 1 if steps is None else max(steps, 0)

    def _refresh(self, step: int) -> None:
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
        self.predictions.refresh(step, batch, len(active))
        advice = self.predictions.recommendation
        if advice is not None and advice != self.adopted and self.config.follow_recommendation:
            self.adopt(advice)

    def _install(self, base: Policy) -> Policy:
        wrapped = self.wrap(base) if self.wrap is not None else base
        return ShadowPolicy(wrapped, self.shadows) if self.shadows else wrapped

    def adopt(self, advice: dict) -> bool:
        """Route from now on as ``advice`` says (``{"policy": "br0"}`` or ``{"policy": "brh",
        "horizon", "beta", "gamma", ...}``); returns whether it was adopted."""
        self.adopted = advice
        if not self.owns_policy:
            return False
        try:
            # from the configured parameters, not the adopted ones: a BR-0 recommendation
            # must not strip BR-H's own settings (short_pool, fit_horizon, ...) for the next
            if advice.get("policy") == "br0":
                params = self.config.params.as_br0()
            elif advice.get("policy") == "brh":
                beta = advice.get("beta")  # None: alpha * G
                pool = advice.get("learned_short_pool")  # absent: the configured rule
                if pool is not None and not isinstance(pool, bool):
                    raise ParameterError("learned_short_pool", "must be true or false")
                params = replace(self.config.params, horizon=int(advice["horizon"]),
                                 beta=None if beta is None else float(beta),
                                 gamma=gamma_value(advice.get("gamma")),
                                 learned_short_pool=(self.config.params.learned_short_pool
                                                     if pool is None else pool))
            else:
                raise ParameterError("policy", f"unknown policy {advice.get('policy')!r}")
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("recommendation %s ignored: %s", advice, exc)
            return False
        base = make_policy("brh" if params.horizon else "br0", params=params)
        if isinstance(base, BalanceRoutePolicy) and isinstance(self.base_policy,
                                                               BalanceRoutePolicy):
            base.waited = self.base_policy.waited  # the guard's count outlives the switch
        self.base_policy = base
        self.policy = self._install(base)
        self.controller.advise_br0(not params.horizon)
        if params.horizon:
            self.predictions.horizon = params.horizon
        self.params = params
        log.warning("router adopts the recommendation %s", advice)
        return True

    def _report(self) -> None:
        outcomes = self.fleet.take_outcomes()
        self.predictions.forget([o["request_id"] for o in outcomes])
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
