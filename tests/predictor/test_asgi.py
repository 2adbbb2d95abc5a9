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


def test_bodies_held_at_once_past_the_budget_get_a_503_and_the_budget_comes_back():
    """Each body is within the limit; the second, arriving while the first is still being
    answered, would take the bodies held past the budget: 503 with Retry-After, and the app
    does not run for it. Once the first is answered its bytes are free again."""
    release = asyncio.Event()
    seen: list[bytes] = []

    async def app(scope, receive, send):
        seen.append((await receive())["body"])
        await release.wait()

    limiter = BodyLimit(app, limit=10, budget=15)

    async def request(body: bytes) -> list[dict]:
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict] = []

        async def receive():
            return messages.pop(0)

        async def send(message):
            sent.append(message)

        await limiter({"type": "http", "method": "POST", "path": "/x", "headers": []},
                      receive, send)
        return sent

    async def scenario():
        first = asyncio.ensure_future(request(b"a" * 10))
        await asyncio.sleep(0)
        assert limiter.held == 10
        second = await request(b"b" * 6)
        assert second[0]["status"] == 503
        assert (b"retry-after", b"1") in second[0]["headers"]
        assert b"holds 15 bytes of request bodies" in second[1]["body"]
        release.set()
        assert await first == []
        assert limiter.held == 0
        assert await request(b"c" * 10) == []

    asyncio.run(scenario())
    assert seen == [b"a" * 10, b"c" * 10]
