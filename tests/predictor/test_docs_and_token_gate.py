"""``/docs`` from bundled assets (no CDN), and the write token checked before the body is
read."""

import asyncio

import pytest
from fastapi.testclient import TestClient

from predictor.app import TokenGate, create_app
from predictor.settings import Settings


@pytest.fixture
def client(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'd.db'}", api_token="s3cret",
                        max_body_bytes=4096)
    with TestClient(create_app(settings)) as c:
        yield c


def test_docs_are_self_hosted(client):
    page = client.get("/docs")
    assert page.status_code == 200
    assert "/docs-assets/swagger-ui-bundle.js" in page.text
    assert "/docs-assets/swagger-ui.css" in page.text
    assert "https://" not in page.text and "http://" not in page.text  # nothing from a CDN
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png"):
        assert client.get(f"/docs-assets/{asset}").status_code == 200
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/redoc").status_code == 404  # ReDoc would need a CDN: not served


@pytest.mark.parametrize("path, method", [
    ("/v1/observations", "POST"), ("/v1/ab-comparisons", "POST"), ("/v1/tunings", "POST"),
    ("/v1/ab-comparisons/" + "a" * 32, "DELETE"), ("/v1/tunings/" + "a" * 32, "DELETE")])
def test_a_write_without_the_token_is_401_before_its_body_is_read(client, path, method):
    # malformed JSON (would be 422) and an oversized body (would be 413): 401 comes first
    for body in (b"{not json", b"x" * 10_000):
        got = client.request(method, path, content=body,
                             headers={"content-type": "application/json"})
        assert got.status_code == 401, got.text
        assert got.headers["www-authenticate"] == "Bearer"
    wrong = client.request(method, path, content=b"{not json",
                           headers={"authorization": "bearer s3cret"})  # scheme is "Bearer"
    assert wrong.status_code == 401
    right = client.request(method, path, content=b"{not json",
                           headers={"authorization": "Bearer s3cret",
                                    "content-type": "application/json"})
    assert right.status_code in (404, 422)  # past the gate: the body is parsed now


def test_reads_need_no_token(client):
    assert client.post("/v1/contributions", json={"items": []}).status_code == 200
    assert client.get("/v1/status").status_code == 200


def test_the_gate_never_receives_the_body():
    async def app(scope, receive, send):  # pragma: no cover - must not be reached
        raise AssertionError("the app ran without a token")

    async def receive():
        raise AssertionError("the gate read the body")

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    gate = TokenGate(app, token="t")
    scope = {"type": "http", "method": "POST", "path": "/v1/observations",
             "headers": [(b"content-length", b"999999999")]}
    asyncio.run(gate(scope, receive, send))
    assert sent[0]["status"] == 401
