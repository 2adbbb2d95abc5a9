"""The body limit shared by the service and the proxy (``predictor.asgi.BodyLimit``), driven
as ASGI directly: what it sends, and whether the app behind it runs."""

from __future__ import annotations

import asyncio

from predictor.asgi import BodyLimit


def _drive(messages: list[dict], headers: list[tuple[bytes, bytes]] | None = None):
    called: list[bytes] = []
    sent: list[dict] = []

    async def app(scope, receive, send):
        called.append((await receive())["body"])

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/x", "headers": headers or []}
    asyncio.run(BodyLimit(app, limit=10)(scope, receive, send))
    return called, sent


def test_a_client_gone_mid_body_is_not_handed_to_the_app():
    """Before, the app read a cut body and raised ClientDisconnect (a logged traceback)."""
    called, sent = _drive([{"type": "http.request", "body": b"abc", "more_body": True},
                           {"type": "http.disconnect"}])
    assert called == [] and sent == []


def test_an_oversized_body_is_a_413_that_closes_the_connection():
    for messages, headers in (
            ([{"type": "http.request", "body": b"x" * 6, "more_body": True},
              {"type": "http.request", "body": b"x" * 6, "more_body": False}], []),
            ([], [(b"content-length", b"11")])):
        called, sent = _drive(messages, headers)
        assert called == []
        assert sent[0]["status"] == 413
        assert (b"connection", b"close") in sent[0]["headers"]
        assert b"over the limit of 10 bytes" in sent[1]["body"]


def test_a_body_within_the_limit_reaches_the_app_whole():
    called, sent = _drive([{"type": "http.request", "body": b"abcde", "more_body": True},
                           {"type": "http.request", "body": b"fghij", "more_body": False}])
    assert called == [b"abcdefghij"] and sent == []
