"""The body limit shared by the service and the proxy (``predictor.asgi.BodyLimit``), driven
as ASGI directly: what it sends, and whether the app behind it runs."""

from __future__ import annotations

import asyncio

import pytest

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


class _Held:
    """Requests to one ``BodyLimit`` whose app holds each body until ``release`` is set."""

    def __init__(self, **options) -> None:
        self.release = asyncio.Event()
        self.seen: list[bytes] = []

        async def app(scope, receive, send):
            self.seen.append((await receive())["body"])
            await self.release.wait()

        self.limiter = BodyLimit(app, **options)

    async def request(self, body: bytes, client: str = "10.0.0.1",
                      headers: list | None = None) -> list[dict]:
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict] = []

        async def receive():
            return messages.pop(0)

        async def send(message):
            sent.append(message)

        await self.limiter({"type": "http", "method": "POST", "path": "/x",
                            "headers": headers or [], "client": (client, 1234)}, receive, send)
        return sent


def test_bodies_held_at_once_past_the_budget_get_a_503_and_the_budget_comes_back():
    """Each body is within the limit; one arriving while others are still being answered
    would take the bodies held past the budget: 503 with Retry-After, and the app does not
    run for it. Once they are answered their bytes are free again."""
    held = _Held(limit=10, budget=15, client_share=1.0)

    async def scenario():
        first = asyncio.ensure_future(held.request(b"a" * 10, "10.0.0.1"))
        await asyncio.sleep(0)
        assert held.limiter.held == 10
        second = await held.request(b"b" * 6, "10.0.0.2")
        assert second[0]["status"] == 503
        assert (b"retry-after", b"1") in second[0]["headers"]
        assert b"the server holds 15 bytes of request bodies" in second[1]["body"]
        held.release.set()
        assert await first == []
        assert held.limiter.held == 0 and held.limiter.by_client == {}
        assert await held.request(b"c" * 10, "10.0.0.2") == []

    asyncio.run(scenario())
    assert held.seen == [b"a" * 10, b"c" * 10]


def test_one_client_holds_at_most_its_share_and_others_still_get_in():
    held = _Held(limit=10, budget=40, client_share=0.25)  # 10 bytes per client address

    async def scenario():
        first = asyncio.ensure_future(held.request(b"a" * 8, "10.0.0.1"))
        await asyncio.sleep(0)
        again = await held.request(b"b" * 4, "10.0.0.1")
        assert again[0]["status"] == 503
        assert b"this client holds 10 bytes" in again[1]["body"]
        other = asyncio.ensure_future(held.request(b"c" * 8, "10.0.0.2"))
        await asyncio.sleep(0)
        assert held.limiter.held == 16
        held.release.set()
        assert await first == [] and await other == []
        assert held.limiter.held == 0

    asyncio.run(scenario())
    assert held.seen == [b"a" * 8, b"c" * 8]


def test_a_declared_length_past_what_is_left_is_refused_before_a_byte_is_read():
    held = _Held(limit=10, budget=15, client_share=1.0)

    async def scenario():
        first = asyncio.ensure_future(held.request(b"a" * 10, "10.0.0.1"))
        await asyncio.sleep(0)
        messages_left = [{"type": "http.request", "body": b"b" * 9, "more_body": False}]
        sent: list[dict] = []

        async def receive():
            return messages_left.pop(0)

        async def send(message):
            sent.append(message)

        await held.limiter({"type": "http", "method": "POST", "path": "/x", "client": ("x", 1),
                            "headers": [(b"content-length", b"9")]}, receive, send)
        assert sent[0]["status"] == 503 and len(messages_left) == 1  # nothing read
        held.release.set()
        await first

    asyncio.run(scenario())


def test_a_stalled_upload_gets_a_408_and_gives_its_bytes_back():
    async def app(scope, receive, send):
        raise AssertionError("the app must not run")

    limiter = BodyLimit(app, limit=100, budget=1000, read_timeout_s=0.05)
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": b"abc", "more_body": True}]

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(10)  # the rest never comes

    async def send(message):
        sent.append(message)

    asyncio.run(limiter({"type": "http", "method": "POST", "path": "/x", "headers": []},
                        receive, send))
    assert sent[0]["status"] == 408
    assert b"not received whole within 0.05 s" in sent[1]["body"]
    assert limiter.held == 0 and limiter.by_client == {}


def test_an_app_that_fails_gives_the_bytes_back():
    async def app(scope, receive, send):
        await receive()
        raise RuntimeError("boom")

    limiter = BodyLimit(app, limit=100, budget=1000)

    async def receive():
        return {"type": "http.request", "body": b"abc", "more_body": False}

    async def send(message):
        raise AssertionError("nothing is sent here")

    with pytest.raises(RuntimeError):
        asyncio.run(limiter({"type": "http", "method": "POST", "path": "/x", "headers": []},
                            receive, send))
    assert limiter.held == 0 and limiter.by_client == {}
