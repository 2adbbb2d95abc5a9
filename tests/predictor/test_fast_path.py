"""``POST /v1/contributions`` past FastAPI's layers (``ContributionsFastPath``): the route's
answer, byte for byte; every error left to the route, the body replayed whole; the request
metrics' label kept."""

import asyncio
from types import SimpleNamespace

import orjson
import pytest
from fastapi.testclient import TestClient

from predictor.app import ContributionsFastPath, create_app
from predictor.asgi import replay_body
from predictor.metrics import Metrics
from predictor.service import PredictorService
from predictor.settings import Settings
from predictor.store import make_engine

OBSERVATIONS = [
    {"request_id": f"t{i}", "prompt_key": "tpl", "prompt_tokens": 100,
     "output_tokens": 5 + i, "finish_reason": "stop"} for i in range(6)] + [
    {"request_id": f"o{i}", "prompt_tokens": 300, "output_tokens": 40 + 10 * i,
     "finish_reason": "length" if i == 3 else "stop"} for i in range(8)]
ITEMS = [
    {"request_id": "a", "prompt_key": "tpl", "prompt_tokens": 100, "generated_tokens": 2},
    {"request_id": "b", "prompt_key": "new", "generated_tokens": 0},
    {"request_id": "c", "prompt": "some text", "prompt_tokens": 50, "generated_tokens": 45},
    {"request_id": "d", "generated_tokens": 500},
]
QUERIES = [
    {"horizon": 40, "items": ITEMS},
    {"horizon": 40, "estimator": "exact_match", "items": ITEMS},
    {"estimator": "hazard", "columns": {"request_id": ["a", "b"], "prompt_key": ["tpl", None],
                                        "generated_tokens": [2, 7]}},
]


def settings(path):
    return Settings(database_url=f"sqlite:///{path}", exact_match_min_support=2,
                    max_items_per_query=8)


def without_fast_path(app):
    app.user_middleware = [m for m in app.user_middleware if m.cls is not ContributionsFastPath]
    return app


def test_the_fast_path_answers_as_the_route(tmp_path):
    """Two services fed the same observations, one app with the fast path and one without:
    the same bytes for every query, and the same errors for bad ones."""
    bad = [{"horizon": 40, "items": [{"request_id": "a"}]},  # generated_tokens missing
           {"estimator": "nope", "items": ITEMS},
           {"items": ITEMS * 3},  # 12 items: over the limit of 8
           {"items": ITEMS, "columns": {"request_id": ["a"], "generated_tokens": [1]}},
           {"columns": {"request_id": ["a", "b"], "generated_tokens": [1]}}]
    with (TestClient(create_app(settings(tmp_path / "fast.db"))) as fast,
          TestClient(without_fast_path(create_app(settings(tmp_path / "slow.db")))) as slow):
        for client in (fast, slow):
            assert client.post("/v1/observations",
                               json={"observations": OBSERVATIONS}).status_code == 200
        for query in QUERIES + bad:
            by_fast = fast.post("/v1/contributions", content=orjson.dumps(query))
            by_route = slow.post("/v1/contributions", content=orjson.dumps(query))
            assert (by_fast.status_code, by_fast.content) == (
                by_route.status_code, by_route.content), query
        codes = [fast.post("/v1/contributions", json=q).status_code for q in bad]
        assert codes == [422, 422, 413, 422, 422]
        metrics = fast.get("/metrics").text
    # labelled as the route, whichever way the query went
    assert ('balanceroute_http_requests_total{endpoint="/v1/contributions",method="POST",'
            'status="200"} 3.0') in metrics
    assert 'status="422"' in metrics and "unmatched" not in metrics


def test_an_unexpected_error_is_the_apps_503_either_way(tmp_path, monkeypatch):
    """A failure inside the answer: the app's 503 (not a 500), with and without the fast
    path, counted under the route's label and as the 503 it is, both ways."""
    def broken(*args, **kwargs):
        raise RuntimeError("a learner failed")

    answers, metrics = [], []
    for name, build in (("fast", create_app), ("slow", lambda c: without_fast_path(
            create_app(c)))):
        with TestClient(build(settings(tmp_path / f"{name}.db")),
                        raise_server_exceptions=False) as client:
            monkeypatch.setattr(client.app.state.service, "contributions", broken)
            got = client.post("/v1/contributions", content=orjson.dumps(QUERIES[0]))
            answers.append((got.status_code, got.content))
            metrics.append([line for line in client.get("/metrics").text.splitlines()
                            if line.startswith("balanceroute_http_requests_total{")
                            and "/metrics" not in line])
    assert answers[0] == answers[1] and answers[0][0] == 503
    assert metrics[0] == metrics[1] and len(metrics[0]) == 1
    assert 'endpoint="/v1/contributions",method="POST",status="503"' in metrics[0][0]


def test_only_a_success_is_answered_past_the_router(tmp_path):
    """A valid query never reaches the app behind; a refused one reaches it with its body
    replayed whole; other paths and methods go straight through."""
    service = PredictorService(settings(tmp_path / "s.db"), make_engine(
        f"sqlite:///{tmp_path / 's.db'}"))
    service.load()
    service.ingest(OBSERVATIONS)
    behind: list[tuple[str, str, bytes]] = []

    async def app_behind(scope, receive, send):
        message = await receive()
        behind.append((scope["method"], scope["path"], message["body"]))
        await send({"type": "http.response.start", "status": 418, "headers": []})
        await send({"type": "http.response.body", "body": b"behind"})

    callers: list[str] = []
    record = service.record
    service.record = lambda *args: callers.append(args[-1]) or record(*args)  # type: ignore
    fast = ContributionsFastPath(app_behind, SimpleNamespace(service=service, metrics=Metrics()))
    client = TestClient(fast, client=("10.1.2.3", 5000))  # no lifespan: HTTP only behind
    for query in QUERIES:
        answer = client.post("/v1/contributions", content=orjson.dumps(query))
        assert answer.status_code == 200
        assert answer.json()["horizon"] == query.get("horizon", 80)
    assert behind == []
    assert callers == ["10.1.2.3"] * len(QUERIES)  # the calibration sample knows the caller
    refused = orjson.dumps({"items": ITEMS * 3})  # over the limit: the route's 413
    assert client.post("/v1/contributions", content=refused).status_code == 418
    assert client.post("/v1/observations", content=b"{}").status_code == 418
    assert client.get("/v1/contributions").status_code == 418
    assert behind == [("POST", "/v1/contributions", refused), ("POST", "/v1/observations", b"{}"),
                      ("GET", "/v1/contributions", b"")]
    service.engine.dispose()


@pytest.mark.parametrize("last", [None, {"type": "http.disconnect"}])
def test_replay_gives_the_body_read_then_what_cut_it_short(last):
    async def never():
        raise AssertionError("read past the replay")

    async def run():
        receive = replay_body([b"ab", b"", b"cd"], last, never)
        first = await receive()
        return first, (await receive() if last else None)

    first, second = asyncio.run(run())
    assert first == {"type": "http.request", "body": b"abcd", "more_body": last is not None}
    assert second == last


def test_small_queries_are_answered_on_the_loop_while_the_learners_are_free(tmp_path,
                                                                            monkeypatch):
    """Up to ``INLINE_ITEMS`` requests, with the learners' lock free: answered on the event
    loop's own thread; a larger query, or one that comes while an ingestion holds the lock,
    on a worker thread (the loop never waits on the lock), with the same answer."""
    import threading
    import time

    import predictor.app as app_module

    service = PredictorService(settings(tmp_path / "s.db"), make_engine(
        f"sqlite:///{tmp_path / 's.db'}"))
    service.load()
    service.ingest(OBSERVATIONS)
    threads: list[str] = []
    contributions = service.contributions
    monkeypatch.setattr(service, "contributions", lambda *args: (
        threads.append(threading.current_thread().name), contributions(*args))[1])
    client = TestClient(ContributionsFastPath(None, SimpleNamespace(service=service,
                                                                    metrics=Metrics())))
    query = orjson.dumps({"horizon": 40, "items": ITEMS})
    inline = client.post("/v1/contributions", content=query)
    monkeypatch.setattr(app_module, "INLINE_ITEMS", len(ITEMS) - 1)
    pooled = client.post("/v1/contributions", content=query)
    monkeypatch.setattr(app_module, "INLINE_ITEMS", len(ITEMS))
    held = threading.Event()

    def ingestion() -> None:  # holds the learners' lock for a while
        with service.lock:
            held.set()
            time.sleep(0.3)

    holder = threading.Thread(target=ingestion)
    holder.start()
    assert held.wait(timeout=10)
    waited = client.post("/v1/contributions", content=query)
    holder.join()
    assert inline.content == pooled.content == waited.content
    assert inline.status_code == 200
    loop, *workers = threads
    assert not loop.startswith("AnyIO worker")
    assert all(name.startswith("AnyIO worker") for name in workers) and len(workers) == 2
    service.engine.dispose()


def test_a_client_gone_mid_body_is_counted_as_a_499_not_a_503(tmp_path):
    """Nothing is answered to a client that left mid-body; the request metrics used to count
    it as the 503 of an escaped error."""
    app = create_app(settings(tmp_path / "gone.db"))
    messages = [{"type": "http.request", "body": b'{"observations": [', "more_body": True},
                {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    with TestClient(app) as client:
        scope = {"type": "http", "method": "POST", "path": "/v1/observations",
                 "raw_path": b"/v1/observations", "query_string": b"", "headers": [],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "scheme": "http",
                 "http_version": "1.1", "root_path": "", "app": app}
        client.portal.call(app, scope, receive, send)
        metrics = client.get("/metrics").text
    assert sent == []
    assert 'method="POST",status="499"} 1.0' in metrics
    assert 'status="503"' not in metrics
