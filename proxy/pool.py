"""The proxy's half of the Prompt Pool: one waiter per request, bounded.

The router's half is ``RouterClient.fleet.pool`` (prompt tokens, entry time, TTL). Here each
request that joined the pool has a :class:`Pending` entry with the future its handler awaits;
the dispatcher resolves it with the chosen rank. An entry stays until its handler ends (pool,
dispatched or streaming), so ``live_on(rank)`` is the proxy's own record of what each rank
runs, the reference for reconciliation.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


class PoolFull(Exception):
    """The pool holds ``max_size`` waiting requests already."""


class PoolExpired(Exception):
    """The request waited past the pool TTL (or was dropped from the pool) without a rank."""


class NoRankUp(PoolExpired):
    """No decode rank has been up for the proxy's ``--down-grace``: the request leaves the
    pool with the 503 a new request gets at once."""


@dataclass(eq=False)
class Pending:
    request_id: str
    entered: float
    future: asyncio.Future[int]
    rank: int | None = None


@dataclass
class PendingPool:
    max_size: int = 4096
    entries: dict[str, Pending] = field(default_factory=dict)
    waiting: int = 0

    def join(self, request_id: str, now: float) -> Pending:
        if self.waiting >= self.max_size:
            raise PoolFull(request_id)
        entry = Pending(request_id, now, asyncio.get_running_loop().create_future())
        self.entries[request_id] = entry
        self.waiting += 1
        return entry

    def resolve(self, request_id: str, rank: int) -> Pending | None:
        entry = self.entries.get(request_id)
        if entry is None or entry.future.done():
            return None
        entry.rank = rank
        entry.future.set_result(rank)
        self.waiting -= 1
        return entry

    def expire(self, request_id: str, error: PoolExpired | None = None) -> None:
        entry = self.entries.get(request_id)
        if entry is not None and not entry.future.done():
            entry.future.set_exception(error or PoolExpired(request_id))
            self.waiting -= 1

    def leave(self, request_id: str) -> None:
        entry = self.entries.pop(request_id, None)
        if entry is not None and not entry.future.done():
            entry.future.cancel()
            self.waiting -= 1

    def undispatched(self) -> list[str]:
        return [rid for rid, entry in self.entries.items() if not entry.future.done()]

    def live_on(self, rank: int) -> set[str]:
        return {rid for rid, entry in self.entries.items() if entry.rank == rank}
