"""The decode dispatcher: runs the router when the pool is non-empty or a slot frees.

``RouterClient`` is the single source of fleet state. Two small adapters sit between it and
the proxy (the policy is given to RouterClient's constructor already wrapped):

- :class:`RankMaskPolicy` wraps any policy (``br0``/``brh`` as RouterClient builds them, or a
  baseline from ``router_client.policies.make_policy``): ranks that are down show no free
  slot, and the stats of the last round are kept for metrics.
- :class:`BackgroundPredictor` makes prediction refresh non-blocking: ``predict`` answers at
  once from the last completed refresh (``c_hat``, the two-point law and the service's
  recommendation; requests it has not seen get the prior ``H``) and starts the next refresh
  on a worker thread; before the first answer it is ``warming`` (BR-0, not a failure); a
  failed or stale (``max_age_s``) answer is ``Prediction(None)`` and a drifted one flagged,
  so RouterClient falls back to BR-0 as usual. Predictions are therefore one refresh old;
  RouterClient ages them by the ticks since.

Rounds run on the event loop (BR-0/BR-H rounds take about a millisecond at G = 8); a wake-up
coalesces every arrival and freed slot since the previous round. BR may leave a free slot
empty on purpose (admitting would overflow the current maximum); the simulator's router then
tries again at the next decode step, so here too, while requests wait and an up rank has a
free slot, another round follows ``round_interval_s`` later (about one decode step).
With ``min_round_s`` (the proxy's ``--step-ms``) rounds are at least that far apart: one per
decode step, as in the simulator, since the router's step counters (the starvation guard's,
the refresh cadence) count rounds; events of the same step then join one round.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from time import perf_counter

import numpy as np

from router_client.client import RouterClient
from router_client.fleet import FleetView, WaitingRequest
from router_client.policies import Decision, Policy
from router_client.predictors import (
    ActiveBatch,
    FinishedBatch,
    Prediction,
    Predictor,
    aged_c_hat,
    tokens_since,
)
from router_client.projection import END_SHAPE, aged_law

from .metrics import ProxyMetrics
from .pool import NoRankUp, PendingPool

log = logging.getLogger("balanceroute.proxy")


class RankMaskPolicy:
    """A policy that never routes to a rank marked down."""

    def __init__(self, inner: Policy, up: list[bool]) -> None:
        self.inner = inner
        self.up = up  # shared with the engine set, updated in place
        self.last: Decision | None = None

    def around(self, inner: Policy) -> RankMaskPolicy:
        """Mask ``inner`` from now on (the same mask object, so its users keep it)."""
        self.inner = inner
        return self

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def needs_predictions(self) -> bool:
        return self.inner.needs_predictions

    def route(self, fleet: FleetView, pool: list[WaitingRequest]) -> Decision:
        if not all(self.up):
            up = np.asarray(self.up, dtype=bool)
            counts = np.where(up, fleet.active_counts, fleet.capacity)
            # a down rank looks full (and is marked down: the guard idle does not count it);
            # everything else of the view (the predictor's law, the pool's c_hat, the
            # arrival rate) is kept
            fleet = replace(fleet, active_counts=counts, down=~up)
        if not (fleet.free_slots > 0).any():
            self.last = Decision([])
            return self.last
        self.last = self.inner.route(fleet, pool)
        return self.last


class MaxTokensPredictor:
    """BR-H's lengths from each request's own ``max_tokens``: ``c_hat = min(max_tokens -
    generated, H)``, true lengths where the client sends ``ignore_eos`` (a benchmark's replay,
    as ``bench proxy-ab`` sends), an upper bound otherwise; a request without one gets the
    prior (``c_hat = H``). The proxy's counterpart of the simulator's oracle, to tell what the
    proxy's mechanics cost BR-H from what the predictions cost it (``--lengths-from
    max-tokens``). In process: it answers at once, never fails or drifts."""

    name = "max-tokens"

    def __init__(self) -> None:
        self.limits: dict[str, int] = {}

    def expect(self, request_id: str, max_tokens: object) -> None:
        """Note a request's ``max_tokens`` as it enters the pool (ignored unless an int >= 1)."""
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1:
            self.limits[request_id] = max_tokens

    def predict(self, batch: ActiveBatch, horizon: int) -> Prediction:
        ids = [str(r) for r in batch.request_ids.tolist()]
        # The batch is every request the router holds (running and waiting): forget the
        # rest, such as requests that left the pool without running (no outcome comes back).
        self.limits = {r: self.limits[r] for r in ids if r in self.limits}
        limits = np.fromiter((self.limits.get(r, -1) for r in ids), np.int64, len(ids))
        remaining = np.clip(limits - np.asarray(batch.generated_tokens, dtype=np.int64), 1,
                            horizon).astype(np.float64)
        return Prediction(np.where(limits >= 1, remaining, float(horizon)))

    def observe(self, finished: FinishedBatch) -> None:
        for request_id in finished.request_ids.tolist():
            self.limits.pop(str(request_id), None)


class BackgroundPredictor:
    """A :class:`Predictor` whose ``predict`` never waits on the network.

    It answers from the last completed refresh, everything the inner predictor gave: ``c_hat``,
    the two-point law (``p_fin``, ``mu_rem``) and the service's recommendation, aged by the
    tokens each request generated since that refresh asked about it (the answer is one refresh
    old: the query of this call is answered at a later one), as
    :class:`~router_client.prediction.PredictionCache` ages it between refreshes. A request the
    refresh did not ask about gets the prior: ``c_hat = H``, not ending within the window.
    Before the first answer it says ``warming`` (not a failure); a failed or stale answer is
    ``Prediction(None)`` and a drifted one is flagged, so RouterClient falls back to BR-0.
    """

    def __init__(self, inner: Predictor, max_age_s: float = 10.0,
                 end_shape: str = END_SHAPE) -> None:
        self.inner = inner
        self.end_shape = end_shape  # how the law ages (router_client.projection.aged_law)
        self.name = getattr(inner, "name", "background")
        self.max_age_s = max_age_s
        self.lock = threading.Lock()
        # request id -> (c_hat, p_fin, mu_rem, tokens generated when asked); p_fin and mu_rem
        # NaN when the answer had none
        self.answer: dict[str, tuple[float, float, float, int]] | None = None
        self.has_law = False
        self.recommendation: dict | None = None
        self.drifted = False
        self.answered_at = 0.0
        self.answered_once = False  # any refresh came back, answer or failure
        self.running = False
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="prediction-refresh")

    def predict(self, batch: ActiveBatch, horizon: int) -> Prediction:
        with self.lock:
            if not self.running:
                self.running = True
                self.executor.submit(self._refresh, batch, horizon)
            answer, drifted, has_law = self.answer, self.drifted, self.has_law
            recommendation, answered_once = self.recommendation, self.answered_once
            stale = time.monotonic() - self.answered_at > self.max_age_s
        if not answered_once:
            return Prediction(None, warming=True)
        if answer is None or stale:
            return Prediction(None)
        prior = (float(horizon), 0.0, float(horizon), -1)  # unseen: runs through the window
        rows = [answer.get(str(r), prior) for r in batch.request_ids.tolist()]
        n = len(rows)
        elapsed = tokens_since(batch.generated_tokens,
                               np.fromiter((row[3] for row in rows), np.int64, n))
        c_hat = aged_c_hat(np.fromiter((row[0] for row in rows), np.float64, n), elapsed,
                           horizon)
        p_fin = mu_rem = None
        if has_law:
            p_fin = np.fromiter((row[1] for row in rows), np.float64, n)
            p_fin, mu_rem = aged_law(p_fin, np.fromiter((row[2] for row in rows), np.float64, n),
                                     elapsed, horizon, self.end_shape)
        return Prediction(c_hat, drifted=drifted, recommendation=recommendation,
                          p_fin=p_fin, mu_rem=mu_rem)

    def _refresh(self, batch: ActiveBatch, horizon: int) -> None:
        try:
            prediction = self.inner.predict(batch, horizon)
        except Exception:  # a predictor bug must not stop refreshes: treat as unavailable
            log.exception("prediction refresh raised")
            prediction = Prediction(None)
        with self.lock:
            self.running = False
            self.answered_once = True
            if prediction.c_hat is None:
                self.answer = None
                return
            ids = [str(r) for r in batch.request_ids.tolist()]
            c_hat = np.asarray(prediction.c_hat, dtype=np.float64).tolist()
            self.has_law = prediction.p_fin is not None and prediction.mu_rem is not None
            laws: list[tuple[float, float]] = [(math.nan, math.nan)] * len(ids)
            if self.has_law:
                laws = list(zip(np.asarray(prediction.p_fin, dtype=np.float64).tolist(),
                                np.asarray(prediction.mu_rem, dtype=np.float64).tolist(),
                                strict=True))
            asked = np.asarray(batch.generated_tokens, dtype=np.int64).tolist()
            self.answer = {r: (c, p, m, g) for r, c, (p, m), g
                           in zip(ids, c_hat, laws, asked, strict=True)}
            self.drifted = prediction.drifted
            if prediction.recommendation is not None:
                self.recommendation = prediction.recommendation
            self.answered_at = time.monotonic()

    def observe(self, finished: FinishedBatch) -> None:
        self.inner.observe(finished)  # HttpPredictor only buffers; its reporter sends

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


class Dispatcher:
    def __init__(self, client: RouterClient, pending: PendingPool, metrics: ProxyMetrics,
                 policy: RankMaskPolicy, up: list[bool], round_interval_s: float = 0.01,
                 min_round_s: float = 0.0, alive: Callable[[], bool] | None = None,
                 down_grace_s: float = math.inf, start_after: int = 0,
                 start_timeout_s: float = 30.0) -> None:
        self.client = client
        # the first round waits for this many requests in the pool (or start_timeout_s after
        # the first): a first wave routed as it trickles in (a few requests a round, a short
        # pool placed with no choice) starts the fleet unbalanced
        self.start_after = start_after
        self.start_timeout_s = start_timeout_s
        self.round_interval_s = round_interval_s
        self.min_round_s = min_round_s
        self._retry: asyncio.TimerHandle | None = None
        self.pending = pending
        self.metrics = metrics
        self.policy = policy
        self.up = up
        self._wake = asyncio.Event()
        self.rounds = 0
        self._expired_seen = 0
        self._fallback_seen = 0
        self.alive = alive  # whether any decode rank is up (held back or not)
        self.down_grace_s = down_grace_s
        self._down_since: float | None = None

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        last = -math.inf
        if self.start_after > 0:
            await self._wake.wait()
            deadline = loop.time() + self.start_timeout_s
            while len(self.client.fleet.pool) < self.start_after and loop.time() < deadline:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), deadline - loop.time())
                except TimeoutError:
                    break
        while True:
            await self._wake.wait()
            # At most one round per decode step (the router's step counters, the starvation
            # guard's included, count rounds): events of the same step join one round.
            wait = last + self.min_round_s - loop.time()
            await asyncio.sleep(wait if wait > 0 else 0)
            self._wake.clear()
            last = loop.time()
            try:
                self.round()
            except Exception:  # keep routing; the state check in tests catches real faults
                log.exception("routing round failed")
            if self._retry is None and self.client.fleet.pool and self._free_up_slots():
                self._retry = asyncio.get_running_loop().call_later(self.round_interval_s,
                                                                    self._retry_round)

    def _retry_round(self) -> None:
        self._retry = None
        self.wake()

    def _free_up_slots(self) -> bool:
        fleet = self.client.fleet
        return any(up and len(members) < fleet.capacity
                   for up, members in zip(self.up, fleet.per_worker, strict=True))

    async def reaper(self, interval_s: float) -> None:
        """Pool TTL and silent-request TTL are enforced inside ``tick``; wake it regularly."""
        while True:
            await asyncio.sleep(interval_s)
            self.wake()

    def _fail_while_none_up(self, now: float) -> None:
        """With no decode rank up for ``down_grace_s``, the requests waiting in the pool get
        the 503 a new request gets at once (:class:`~proxy.pool.NoRankUp`), instead of
        waiting out the pool TTL; within the grace a rank that comes back (a restart) takes
        them."""
        if self.alive is None or self.alive():
            self._down_since = None
            return
        if self._down_since is None:
            self._down_since = now
        if now - self._down_since < self.down_grace_s:
            return
        for request_id in self.pending.undispatched():
            self.client.on_cancel(request_id, now)  # out of the router's pool too
            self.pending.expire(request_id, NoRankUp(request_id))

    def round(self) -> None:
        now = time.monotonic()
        self._fail_while_none_up(now)
        waiting = len(self.client.fleet.pool)
        if waiting and self._free_up_slots():
            self.metrics.round_pool.observe(waiting)
        started = perf_counter()
        self.policy.last = None
        dispatches = self.client.tick(now)
        elapsed = perf_counter() - started
        self.rounds += 1
        metrics = self.metrics
        decision = self.policy.last
        if decision is not None:
            metrics.router_latency.observe(elapsed)
            stats = decision.stats
            for stage in ("stage1", "stage2"):
                seconds = stats.extra.get(f"{stage}_s")
                if seconds is not None:
                    metrics.stage_latency.labels(stage).observe(seconds)
            if stats.stage1_admissions:
                metrics.admissions.labels("stage1").inc(stats.stage1_admissions)
            if stats.stage2_admissions:
                metrics.admissions.labels("stage2").inc(stats.stage2_admissions)
            if stats.starvation_guard_admissions:
                metrics.guard.inc(stats.starvation_guard_admissions)
            if stats.waited:
                metrics.guard_waits.inc(len(stats.waited))
            if stats.patience_admissions:
                metrics.patience.inc(stats.patience_admissions)
            if "gamma" in stats.extra:
                metrics.gamma.set(stats.extra["gamma"])
        for request_id, rank in dispatches:
            entry = self.pending.resolve(request_id, rank)
            if entry is None:  # its handler is gone: the slot must not stay taken
                self.client.on_cancel(request_id, now)
                continue
            metrics.pool_wait.observe(now - entry.entered)
        fleet = self.client.fleet
        if fleet.counters.pool_expired != self._expired_seen:
            metrics.pool_expired.inc(fleet.counters.pool_expired - self._expired_seen)
            self._expired_seen = fleet.counters.pool_expired
            for request_id in self.pending.undispatched():
                if request_id not in fleet.pool:
                    self.pending.expire(request_id)
        if self.client.fallback_rounds != self._fallback_seen:
            metrics.fallback_rounds.inc(self.client.fallback_rounds - self._fallback_seen)
            self._fallback_seen = self.client.fallback_rounds

    def publish(self) -> None:
        """Per-rank gauges and imbalance from the mirrored state (at scrape time)."""
        view, pool = self.client.fleet.view()
        self.metrics.set_fleet(view.loads, view.active_counts, self.up)
        self.metrics.pool_depth.set(len(pool))
