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


def test_requests_refused_before_routing_are_counted_under_their_route(client):
    """The token gate's 401 and the body limit's 413 answer before the app routes: they are
    counted under the route the path matches (they once all went to ``unmatched``); a path
    no route serves stays ``unmatched``."""
    assert client.post("/v1/observations", content=b"{}").status_code == 401
    auth = {"authorization": "Bearer s3cret", "content-type": "application/json"}
    assert client.post("/v1/observations", content=b"x" * 10_000,
                       headers=auth).status_code == 413
    assert client.delete("/v1/tunings/" + "a" * 32).status_code == 401
    assert client.get("/v1/nowhere").status_code == 404
    # a path served for another method: under that route (the app would answer 405)
    assert client.put("/v1/contributions", content=b"x" * 40_000_000).status_code == 413
    metrics = client.get("/metrics").text
    for endpoint, method, status in (("/v1/contributions", "PUT", 413),
                                     ("/v1/observations", "POST", 401),
                                     ("/v1/observations", "POST", 413),
                                     ("/v1/tunings/{job_id}", "DELETE", 401),
                                     ("unmatched", "GET", 404)):
        assert (f'balanceroute_http_requests_total{{endpoint="{endpoint}",method="{method}",'
                f'status="{status}"}} 1.0') in metrics, (endpoint, status)
    assert 'endpoint="unmatched",method="POST"' not in metrics
