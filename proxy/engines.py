"""Decode (and prefill) engines seen from the proxy: health, probing, reconciliation.

At start every rank is asked ``GET /v1/models`` once; one that does not answer is marked
down. A rank whose connection fails, or whose stream breaks mid-way, is marked down: the router
skips it (:class:`proxy.dispatcher.RankMaskPolicy`), requests streaming from it fail on their
own (their streams are cut) and a probe (``GET /v1/models`` every ``probe_interval_s``) brings
it back. A rank that answers a request with 429 or 503 (busy: an engine's bounded queue is
full, as SGLang's ``--max-queued-requests``) is up but held back: the router skips it for the
seconds its ``Retry-After`` asks (:data:`HOLD_DEFAULT_S` without one; at most
:data:`HOLD_MAX_S`), then routes to it again. Every ``reconcile_interval_s`` the proxy

- drops mirrored requests on a rank that no live handler serves any more (ghosts; the proxy's
  own records are the reference, since vLLM's ``/metrics`` carries counts, not request ids);
- reads the rank's ``/metrics`` (``vllm:num_requests_running`` + ``vllm:num_requests_waiting``)
  and exports the engine's count beside the mirrored one, so a divergence shows on the
  dashboard. A rank whose ``/metrics`` cannot be reached is marked down.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import httpx

from router_client.client import RouterClient

from .metrics import ProxyMetrics
from .pool import PendingPool

log = logging.getLogger("balanceroute.proxy")

_METRIC = re.compile(
    r"^(vllm:num_requests_running|vllm:num_requests_waiting)(\{[^}]*\})?\s+([0-9.eE+-]+)",
    re.M)


HOLD_DEFAULT_S = 1.0  # a busy rank's pause without a Retry-After
HOLD_MAX_S = 30.0  # a busy rank's longest pause, whatever its Retry-After asks


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After``'s seconds, a number of seconds or an HTTP date (None if absent or
    unreadable), not below 0."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - (now or time.time())
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


def engine_requests(metrics_text: str) -> int:
    """Running plus waiting requests in a vLLM-style ``/metrics`` page (summed over labels)."""
    return int(sum(float(m.group(3)) for m in _METRIC.finditer(metrics_text)))


@dataclass
class Engine:
    index: int
    url: str
    up: bool = True
    failures: int = 0
    last_error: str | None = None
    engine_requests: int | None = None
    held_until: float = 0.0  # monotonic time a busy rank is held back until (0: not held)


class EngineSet:
    def __init__(self, urls: list[str], http: httpx.AsyncClient, metrics: ProxyMetrics,
                 on_up: Callable[[], None], probe_interval_s: float = 1.0,
                 kind: str = "decode") -> None:
        self.engines = [Engine(g, url.rstrip("/")) for g, url in enumerate(urls)]
        self.up = [True] * len(urls)  # shared, updated in place (RankMaskPolicy reads it)
        self.http = http
        self.metrics = metrics
        self.on_up = on_up
        self.probe_interval_s = probe_interval_s
        self.kind = kind
        self._probes: dict[int, asyncio.Task[None]] = {}
        self._holds: dict[int, asyncio.Task[None]] = {}

    async def check_all(self) -> None:
        """At start: a rank that does not answer ``GET /v1/models`` is marked down, so it is
        not routed to (nor counted ready) until its probe brings it back. Any HTTP answer
        but a 5xx counts as alive (an engine behind an API key answers 401)."""
        async def check(engine: Engine) -> None:
            problem = await self._unanswered(engine, timeout_s=2.0)
            if problem is not None:
                self.mark_down(engine.index, f"start: {problem}")
        await asyncio.gather(*(check(engine) for engine in self.engines))

    async def _unanswered(self, engine: Engine, timeout_s: float) -> str | None:
        """Why ``engine`` does not answer ``GET /v1/models`` as a live server (None: it does)."""
        try:
            response = await self.http.get(f"{engine.url}/v1/models", timeout=timeout_s)
        except httpx.HTTPError as exc:
            return type(exc).__name__
        return f"HTTP {response.status_code}" if response.status_code >= 500 else None

    def any_alive(self) -> bool:
        """Whether any rank is up, held back or not (a held rank comes back by itself)."""
        return any(engine.up for engine in self.engines)

    def url(self, rank: int) -> str:
        return self.engines[rank].url

    def any_up(self) -> bool:
        return any(self.up)

    def mark_down(self, rank: int, reason: str) -> None:
        engine = self.engines[rank]
        engine.failures += 1
        engine.last_error = reason
        self.metrics.engine_errors.labels(f"{self.kind}{rank}", reason.split(":")[0]).inc()
        if not engine.up:
            return
        engine.up = False
        self.up[rank] = False
        log.warning("%s rank %d (%s) marked down: %s", self.kind, rank, engine.url, reason)
        self._probes[rank] = asyncio.ensure_future(self._probe(rank))

    def hold(self, rank: int, seconds: float | None, reason: str) -> float:
        """Skip ``rank``, which is up but refused a request as busy, for ``seconds`` (its
        ``Retry-After``; :data:`HOLD_DEFAULT_S` if None, at most :data:`HOLD_MAX_S`), or longer
        if it is held already; the seconds it is now held for."""
        engine = self.engines[rank]
        seconds = min(HOLD_MAX_S, HOLD_DEFAULT_S if seconds is None else seconds)
        self.metrics.engine_errors.labels(f"{self.kind}{rank}", reason).inc()
        now = time.monotonic()
        if now + seconds > engine.held_until:
            engine.held_until = now + seconds
            task = self._holds.pop(rank, None)
            if task is not None:
                task.cancel()
            else:
                log.warning("%s rank %d (%s) busy (%s): held back %.1f s", self.kind, rank,
                            engine.url, reason, seconds)
            self._holds[rank] = asyncio.ensure_future(self._release(rank, seconds))
        self.up[rank] = False
        return engine.held_until - now

    def held_for(self) -> float | None:
        """Seconds until the first held rank may be routed to again (None: none is held)."""
        now = time.monotonic()
        waits = [e.held_until - now for e in self.engines if e.held_until > now]
        return max(0.0, min(waits)) if waits else None

    async def _release(self, rank: int, seconds: float) -> None:
        await asyncio.sleep(seconds)
        engine = self.engines[rank]
        engine.held_until = 0.0
        self._holds.pop(rank, None)
        if engine.up:  # a rank marked down meanwhile comes back by its probe
            self.up[rank] = True
            self.on_up()

    async def _probe(self, rank: int) -> None:
        engine = self.engines[rank]
        while True:
            await asyncio.sleep(self.probe_interval_s)
            if await self._unanswered(engine, timeout_s=2.0) is None:
                engine.up = True
                self.up[rank] = engine.held_until <= time.monotonic()
                self._probes.pop(rank, None)
                log.warning("%s rank %d (%s) is back", self.kind, rank, engine.url)
                self.on_up()
                return

    async def reconcile_loop(self, client: RouterClient, pending: PendingPool,
                             interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.reconcile(client, pending)

    async def reconcile(self, client: RouterClient, pending: PendingPool) -> None:
        for engine in self.engines:
            if self.kind == "decode":
                ghosts = client.reconcile(engine.index, pending.live_on(engine.index),
                                          time.monotonic())
                if ghosts:
                    log.warning("rank %d: %d ghost requests dropped", engine.index,
                                len(ghosts))
                    self.metrics.ghosts.inc(len(ghosts))
                    self.on_up()  # slots freed
            if not engine.up:
                continue
            try:
                response = await self.http.get(f"{engine.url}/metrics", timeout=2.0)
            except httpx.HTTPError as exc:
                self.mark_down(engine.index, f"metrics: {type(exc).__name__}")
                continue
            if response.status_code == 200:
                engine.engine_requests = engine_requests(response.text)
                self.metrics.engine_running.labels(f"{self.kind}{engine.index}").set(
                    engine.engine_requests)

    def close(self) -> None:
        for task in [*self._probes.values(), *self._holds.values()]:
            task.cancel()
