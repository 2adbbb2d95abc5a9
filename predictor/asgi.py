"""ASGI pieces shared by the prediction service and the serving proxy (no FastAPI needed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

BODY_LIMIT = 32 * 1024 * 1024  # bytes, the service's and the proxy's default
MIN_BODY_LIMIT = 1024
BODY_BUDGET = 512 * 1024 * 1024  # bytes of all bodies held at once (read, not yet answered)
CLIENT_SHARE = 0.25  # of the budget, one client address may hold
READ_TIMEOUT_S = 60.0  # for one whole body, from its first read

def body_budget(budget: int | None, limit: int) -> int:
    """The budget of bodies held at once: as set, else ``BODY_BUDGET`` or one whole body."""
    return budget if budget is not None else max(BODY_BUDGET, limit)


ErrorBody = Callable[[int, str], dict]  # (status, message) -> the JSON answer


def detail_error(status: int, message: str) -> dict:
    """The prediction service's error body, FastAPI's shape."""
    return {"detail": message}


class BodyLimit:
    """ASGI middleware bounding request bodies, before the app reads any of them.

    - One body over ``limit`` bytes, declared (``Content-Length``) or streamed: 413.
    - All bodies held at once over ``budget`` bytes (read and not yet answered, across
      requests; None: no bound), or one client address's over ``client_share`` of it: 503 with
      ``Retry-After``, so that many bodies each within the limit cannot add up to the memory,
      and one client cannot take the whole budget from the others. A declared length is
      checked before a byte is read; a chunked body as it comes (its 503 may come before the
      413 its size would get).
    - A body not received whole within ``read_timeout_s`` of its first read: 408, so a stalled
      upload does not hold its share.

    ``error(status, message)`` gives the JSON answer (the service's ``{"detail": ...}`` by
    default, OpenAI's ``{"error": ...}`` for the proxy). A client gone mid-body is dropped."""

    def __init__(self, app, limit: int, error: ErrorBody = detail_error,
                 budget: int | None = None, client_share: float = CLIENT_SHARE,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.app = app
        self.limit = limit
        self.error = error
        self.budget = budget
        self.client_budget = 0 if budget is None else max(limit, int(budget * client_share))
        self.read_timeout_s = read_timeout_s
        self.held = 0  # bytes of the bodies held now (one event loop: no lock needed)
        self.by_client: dict[str, int] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        size = int(declared) if declared is not None and declared.isdigit() else 0
        if size > self.limit:
            return await self._reject(send)
        client = (scope.get("client") or ("",))[0]
        if (busy := self._busy_reason(client, size)) is not None:
            return await self._busy(send, busy)
        taken = 0
        chunks: list[bytes] = []
        last: dict | None = None  # a message that cut the body short
        try:
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    while True:  # read the whole body first: an oversized one stores nothing
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            return None  # the client left mid-body: no one to answer
                        if message["type"] != "http.request":
                            last = message
                            break
                        body = message.get("body", b"")
                        if taken + len(body) > self.limit:
                            return await self._reject(send)
                        if (busy := self._busy_reason(client, len(body))) is not None:
                            return await self._busy(send, busy)
                        self._hold(client, len(body))
                        taken += len(body)
                        chunks.append(body)
                        if not message.get("more_body", False):
                            break
            except TimeoutError:
                return await self._answer(send, 408, "request body not received whole within "
                                          f"{self.read_timeout_s:g} s")
            return await self._pass(scope, chunks, last, receive, send)
        finally:
            self._hold(client, -taken)

    def _busy_reason(self, client: str, size: int) -> str | None:
        """Why ``size`` more bytes from ``client`` cannot be held now (None: they can)."""
        if self.budget is None:
            return None
        if self.held + size > self.budget:
            return f"the server holds {self.budget} bytes of request bodies already"
        if self.by_client.get(client, 0) + size > self.client_budget:
            return (f"this client holds {self.client_budget} bytes of request bodies already "
                    "(its share of the server's)")
        return None

    def _hold(self, client: str, size: int) -> None:
        if self.budget is None or size == 0:
            return
        self.held += size
        total = self.by_client.get(client, 0) + size
        if total:
            self.by_client[client] = total
        else:  # no entry kept for a client holding nothing
            del self.by_client[client]

    async def _pass(self, scope, chunks: list[bytes], last: dict | None, receive, send):
        replay = replay_body(chunks, last, receive)
        chunks.clear()  # the body is held once, by the replay and then the app
        return await self.app(scope, replay, send)

    async def _reject(self, send) -> None:
        await self._answer(send, 413, f"request body over the limit of {self.limit} bytes")

    async def _busy(self, send, reason: str) -> None:
        await self._answer(send, 503, f"{reason}; retry later", [(b"retry-after", b"1")])

    async def _answer(self, send, status: int, message: str,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
        body = json.dumps(self.error(status, message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                # else the server reads the rest of the body to keep the
                                # connection, however large it is
                                (b"connection", b"close"), *(extra or [])]})
        await send({"type": "http.response.body", "body": body})


def replay_body(chunks: list[bytes], last: dict | None, receive):
    """An ASGI ``receive`` that gives the body read so far, ``chunks``, as one message, then
    ``last`` (the message that cut the body short, a disconnect) if any, then defers to
    ``receive``."""
    pending: list[dict] = [{"type": "http.request", "body": b"".join(chunks),
                            "more_body": last is not None}]
    if last is not None:
        pending.append(last)

    async def replay():
        return pending.pop(0) if pending else await receive()

    return replay
