"""ASGI pieces shared by the prediction service and the serving proxy (no FastAPI needed)."""

from __future__ import annotations

import json
from collections.abc import Callable

BODY_LIMIT = 32 * 1024 * 1024  # bytes, the service's and the proxy's default
MIN_BODY_LIMIT = 1024


def detail_error(limit: int) -> dict:
    """The prediction service's 413 body, FastAPI's shape."""
    return {"detail": f"request body over the limit of {limit} bytes"}


class BodyLimit:
    """ASGI middleware: 413 for a body over ``limit`` bytes, declared (``Content-Length``) or
    streamed, before the app reads any of it; ``error(limit)`` gives the JSON answer (the
    service's ``{"detail": ...}`` by default, OpenAI's ``{"error": ...}`` for the proxy)."""

    def __init__(self, app, limit: int, error: Callable[[int], dict] = detail_error) -> None:
        self.app = app
        self.limit = limit
        self.error = error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(send)
        received = 0
        chunks: list[bytes] = []
        while True:  # read the whole body first, so an oversized stream stores nothing
            message = await receive()
            if message["type"] == "http.disconnect":
                return None  # the client left mid-body: no one to answer
            if message["type"] != "http.request":
                return await self.app(scope, replay_body(chunks, message, receive), send)
            received += len(message.get("body", b""))
            if received > self.limit:
                return await self._reject(send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return await self.app(scope, replay_body(chunks, None, receive), send)

    async def _reject(self, send) -> None:
        body = json.dumps(self.error(self.limit)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                # else the server reads the rest of the body to keep the
                                # connection, however large it is
                                (b"connection", b"close")]})
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
