"""The router's mirrored view of the fleet: a cache to verify, not a source of truth.

Events arrive from several places (the router's own dispatches, SSE telemetry, client
cancellations, engine reports) and may be duplicated or reordered. Every handler is
idempotent and keeps these invariants (the paper's serving proxy):

- a request is in at most one place: the waiting pool, one worker's active set, or ended;
- no worker holds more than B active requests;
- every end, cancel, expiry or reconciliation frees the request's slot, so at quiescence every
  slot is free.

Ended requests leave a tombstone (bounded, least recent evicted) so that a late or repeated
event about them (a dispatch after a cancel, a progress after a finish) changes nothing.
Dispatches carry the request's admission epoch when known; an older epoch is ignored.

TTLs: a pool entry older than ``pool_ttl_s`` expires (its producer KV would be freed by the
proxy); a dispatched request with no progress for ``active_ttl_s`` expires as ``error``.
``reconcile(worker, ids)`` drops requests the engine no longer reports (ghosts) as ``error``.
Ended requests are queued in ``outcomes`` for reporting to the prediction service.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .errors import ContractError
from .fleet import FleetView, WaitingRequest

ENDED_REASONS = ("stop", "length", "cancelled", "error")


@dataclass
class ActiveRequest:
    request_id: str
    worker: int
    prompt_tokens: int
    prompt_key: str | None
    generated: int = 0
    last_seen: float = 0.0
    epoch: int = 0


@dataclass
class PoolEntry:
    request: WaitingRequest
    entered: float
    epoch: int = 0


@dataclass
class Counters:
    dispatched: int = 0
    finished: int = 0
    cancelled: int = 0
    pool_expired: int = 0
    active_expired: int = 0
    ghosts_removed: int = 0
    ignored_events: int = 0
    rejected_dispatches: int = 0


@dataclass
class MirroredFleet:
    workers: int
    capacity: int
    pool_ttl_s: float = 60.0
    active_ttl_s: float = 120.0
    max_tombstones: int = 100_000
    pool: OrderedDict[str, PoolEntry] = field(default_factory=OrderedDict)
    active: dict[str, ActiveRequest] = field(default_factory=dict)
    per_worker: list[set[str]] = field(default_factory=list)
    ended: OrderedDict[str, str] = field(default_factory=OrderedDict)
    outcomes: list[dict] = field(default_factory=list)
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        if not self.per_worker:
            self.per_worker = [set() for _ in range(self.workers)]

    # -- events ---------------------------------------------------------------------------
    def enqueue(self, request_id: str, prompt_tokens: int, now: float,
                prompt_key: str | None = None, epoch: int = 0) -> bool:
        """A prefilled request enters the pool (ignored if known anywhere)."""
        if self._known(request_id):
            self.counters.ignored_events += 1
            return False
        self.pool[request_id] = PoolEntry(
            WaitingRequest(request_id, int(prompt_tokens), 0, prompt_key), now, epoch)
        return True

    def dispatch(self, request_id: str, worker: int, now: float, epoch: int = 0) -> bool:
        """The router sent the request to ``worker``. Refused if it is not in the pool (ended,
        already dispatched, unknown), from an older epoch, or if the worker is full."""
        entry = self.pool.get(request_id)
        if entry is None or epoch < entry.epoch or not 0 <= worker < self.workers:
            self.counters.ignored_events += 1
            return False
        if len(self.per_worker[worker]) >= self.capacity:
            self.counters.rejected_dispatches += 1
            return False
        del self.pool[request_id]
        request = entry.request
        self.active[request_id] = ActiveRequest(request_id, worker, request.prompt_tokens,
                                                request.prompt_key, 0, now, epoch)
        self.per_worker[worker].add(request_id)
        self.counters.dispatched += 1
        return True

    def progress(self, request_id: str, generated: int, now: float) -> bool:
        """Token progress (monotonic: a smaller, late count is ignored)."""
        request = self.active.get(request_id)
        if request is None:
            self.counters.ignored_events += 1
            return False
        request.generated = max(request.generated, int(generated))
        request.last_seen = max(request.last_seen, now)
        return True

    def finish(self, request_id: str, reason: str, now: float,
               generated: int | None = None) -> bool:
        """The request ended (``stop``/``length``/``error``); frees its slot. Idempotent."""
        if reason not in ENDED_REASONS:
            raise ValueError(f"finish reason must be one of {ENDED_REASONS}")
        if request_id in self.ended:
            self.counters.ignored_events += 1
            return False
        request = self.active.pop(request_id, None)
        if request is not None:
            self.per_worker[request.worker].discard(request_id)
            if generated is not None:
                request.generated = max(request.generated, int(generated))
            self.outcomes.append({
                "request_id": request_id, "prompt_key": request.prompt_key,
                "prompt_tokens": request.prompt_tokens, "output_tokens": request.generated,
                "finish_reason": reason})
        else:
            self.pool.pop(request_id, None)
        # Also for a request never seen (a reordered end): a late enqueue or dispatch of it
        # is then refused.
        self._tombstone(request_id, reason)
        if reason == "cancelled":
            self.counters.cancelled += 1
        else:
            self.counters.finished += 1
        return True

    def cancel(self, request_id: str, now: float) -> bool:
        """Client cancellation, in the pool or after dispatch; frees the slot either way."""
        return self.finish(request_id, "cancelled", now)

    def reap(self, now: float) -> list[str]:
        """Expire pool entries past their TTL and active requests silent past theirs."""
        expired: list[str] = []
        for request_id, entry in list(self.pool.items()):
            if now - entry.entered > self.pool_ttl_s:
                del self.pool[request_id]
                self._tombstone(request_id, "expired")
                self.counters.pool_expired += 1
                expired.append(request_id)
        for request_id, request in list(self.active.items()):
            if now - request.last_seen > self.active_ttl_s:
                self.finish(request_id, "error", now)
                self.counters.active_expired += 1
                expired.append(request_id)
        return expired

    def reconcile(self, worker: int, engine_active: set[str], now: float) -> list[str]:
        """Drop requests the engine no longer reports as active on ``worker`` (ghosts)."""
        ghosts = [r for r in self.per_worker[worker] if r not in engine_active]
        for request_id in ghosts:
            self.finish(request_id, "error", now)
            self.counters.ghosts_removed += 1
        return ghosts

    # -- reading --------------------------------------------------------------------------
    def view(self, c_hat: np.ndarray | None = None) -> tuple[FleetView, list[WaitingRequest]]:
        """The fleet for a routing round; ``c_hat`` one per active request, in the order of
        ``self.active`` (see :class:`~router_client.prediction.PredictionCache`)."""
        ids = list(self.active)
        worker = np.fromiter((self.active[r].worker for r in ids), np.int64, len(ids))
        size = np.fromiter((self.active[r].prompt_tokens + self.active[r].generated
                            for r in ids), np.float64, len(ids))
        if c_hat is not None and len(c_hat) != len(ids):
            raise ContractError(f"{len(c_hat)} c_hat values for {len(ids)} active requests")
        view = FleetView.from_active(self.workers, self.capacity, worker, size, c_hat)
        return view, [entry.request for entry in self.pool.values()]

    def where(self, request_id: str) -> list[str]:
        """Every place the request is recorded (the invariant says at most one)."""
        places = []
        if request_id in self.pool:
            places.append("pool")
        places += [f"worker{g}" for g in range(self.workers) if request_id in self.per_worker[g]]
        if request_id in self.ended:
            places.append("ended")
        return places

    def check(self) -> None:
        """Raise :class:`~router_client.errors.ContractError` if an invariant does not hold."""
        seen: set[str] = set()
        problems: list[str] = []
        for g, members in enumerate(self.per_worker):
            if len(members) > self.capacity:
                problems.append(f"worker {g} holds {len(members)} > B")
            if members & seen:
                problems.append("a request on two workers")
            seen |= members
        if seen != set(self.active):
            problems.append("per-worker sets and active map disagree")
        if seen & set(self.pool):
            problems.append("a request both waiting and active")
        if seen & set(self.ended):
            problems.append("an ended request still active")
        if set(self.pool) & set(self.ended):
            problems.append("an ended request still waiting")
        if problems:
            raise ContractError("mirrored state: " + "; ".join(problems))

    def amend_outcome(self, request_id: str, output_tokens: int) -> bool:
        """A later, authoritative token count (an SSE ``usage`` after the finish chunk) for an
        outcome not yet taken for reporting."""
        for outcome in reversed(self.outcomes):
            if outcome["request_id"] == request_id:
                outcome["output_tokens"] = max(outcome["output_tokens"], int(output_tokens))
                return True
        return False

    def take_outcomes(self) -> list[dict]:
        out, self.outcomes = self.outcomes, []
        return out

    def _known(self, request_id: str) -> bool:
        return request_id in self.pool or request_id in self.active or request_id in self.ended

    def _tombstone(self, request_id: str, reason: str) -> None:
        self.ended[request_id] = reason
        self.ended.move_to_end(request_id)
        while len(self.ended) > self.max_tombstones:
            self.ended.popitem(last=False)
