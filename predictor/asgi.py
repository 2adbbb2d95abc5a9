"""ASGI pieces shared by the prediction service and the serving proxy (no FastAPI needed)."""

from __future__ import annotations

import json
from collections.abc import Callable

BODY_LIMIT = 32 * 1024 * 1024  # bytes, the service's and the proxy's default
MIN_BODY_LIMIT = 1024
BODY_BUDGET = 512 * 1024 * 1024  # bytes of all bodies held at once (read, not yet answered)

ErrorBody = Callable[[int, str], dict]  # (status, message) -> the JSON answer


def detail_error(status: int, message: str) -> dict:
    """The prediction service's error body, FastAPI's shape."""
    return {"detail": message}


class BodyLimit:
    """ASGI middleware bounding request bodies, before the app reads any of them.

    - One body over ``limit`` bytes, declared (``Content-Length``) or streamed: 413.
    - All bodies held at once over ``budget`` bytes (read and not yet answered, across
      requests; None: no bound): 503 with ``Retry-After``, so that many large bodies at once
      cannot exhaust the memory where each alone is within the limit.

    ``error(status, message)`` gives the JSON answer (the service's ``{"detail": ...}`` by
    default, OpenAI's ``{"error": ...}`` for the proxy). A client gone mid-body is dropped."""

    def __init__(self, app, limit: int, error: ErrorBody = detail_error,
                 budget: int | None = None) -> None:
        self.app = app
        self.limit = limit
        self.error = error
        self.budget = budget
        self.held = 0  # bytes of the bodies held now (one event loop: no lock needed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(send)
        taken = 0
        chunks: list[bytes] = []
        try:
            while True:  # read the whole body first, so an oversized stream stores nothing
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None  # the client left mid-body: no one to answer
                if message["type"] != "http.request":
                    return await self._pass(scope, chunks, message, receive, send)
                body = message.get("body", b"")
                if taken + len(body) > self.limit:
                    return await self._reject(send)
                if self.budget is not None and self.held + len(body) > self.budget:
                    return await self._busy(send)
                self.held += len(body)
                taken += len(body)
                chunks.append(body)
                if not message.get("more_body", False):
                    return await self._pass(scope, chunks, None, receive, send)
        finally:
            self.held -= taken

    async def _pass(self, scope, chunks: list[bytes], last: dict | None, receive, send):
        replay = replay_body(chunks, last, receive)
        chunks.clear()  # the body is held once, by the replay and then the app
        return await self.app(scope, replay, send)

    async def _reject(self, send) -> None:
        await self._answer(send, 413, f"request body over the limit of {self.limit} bytes")

    async def _busy(self, send) -> None:
        await self._answer(send, 503, f"the server holds {self.budget} bytes of request bodies "
                           "already; retry later", [(b"retry-after", b"1")])

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
