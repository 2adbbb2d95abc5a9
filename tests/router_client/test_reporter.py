"""The observation reporter: thread-safe, off the routing path, bad outcomes rejected alone,
configuration errors visible, the final flush accounted for."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

from predictor.livesrv import free_port, live_server
from router_client.http_predictor import HttpPredictor
from router_client.predictors import ActiveBatch, FinishedBatch
from router_client.reporter import ObservationReporter, invalid_reason


class CountingService:
    """A tiny local stand-in for the service: counts every request id it is sent."""

    def __init__(self, observations_delay_s: float = 0.0, status: int = 200) -> None:
        self.ids: Counter[str] = Counter()
        self.posts = 0
        self.delay = observations_delay_s
        self.status = status
        self.lock = threading.Lock()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                return None

            def do_POST(self):  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.path == "/v1/observations":
                    time.sleep(service.delay)
                    with service.lock:
                        service.posts += 1
                        if service.status == 200:
                            service.ids.update(o["request_id"] for o in body["observations"])
                    answer = {"accepted": len(body["observations"]), "duplicates": 0}
                    self._reply(service.status, answer)
                else:  # contributions: the prior for everyone, in the layout asked
                    horizon = body.get("horizon", 80)
                    answer = {"horizon": horizon, "model_version": 0, "drifted": False}
                    if "columns" in body:
                        ids = body["columns"]["request_id"]
                        n = len(ids)
                        answer["columns"] = {"request_id": ids, "c_hat": [float(horizon)] * n,
                                             "p_fin": [0.0] * n, "mu_rem": [None] * n}
                    else:
                        answer["items"] = [{"request_id": i["request_id"], "c_hat": float(horizon)}
                                           for i in body["items"]]
                    self._reply(200, answer)

            def _reply(self, status, answer):
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> CountingService:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def service_url(tmp_path_factory):
    """One real service (uvicorn on 127.0.0.1) shared by this module's tests."""
    with live_server(f"sqlite:///{tmp_path_factory.mktemp('rep') / 'rep.db'}") as url:
        yield url


def stored(url: str) -> int:
    return int(httpx.get(url + "/v1/status").json()["observations"])


def active(n: int = 4) -> ActiveBatch:
    return ActiveBatch(np.array([f"a{i}" for i in range(n)], dtype=object),
                       np.full(n, 100), np.zeros(n, dtype=np.int64), [None] * n)


def finished(ids: list[str]) -> FinishedBatch:
    n = len(ids)
    return FinishedBatch(np.array(ids, dtype=object), np.full(n, 100),
                         np.arange(n) % 50 + 1, np.zeros(n, dtype=bool), [None] * n)


def outcomes(prefix: str, n: int) -> list[dict]:
    return [{"request_id": f"{prefix}{i}", "output_tokens": 5 + i % 40} for i in range(n)]


def test_started_reporter_and_concurrent_predicts_deliver_every_outcome_once(service_url):
    """The crash of issue 12: ``reporter.start()`` plus ``predict()`` flushing too, from
    several routing threads, against the real service. Every outcome arrives exactly once."""
    threads, per_thread, chunk = 4, 1500, 25
    url = service_url
    before = stored(url)
    predictor = HttpPredictor(url, "survival", report="sync", timeout_s=5.0)
    predictor.reporter.batch_size = 100  # many small batches: many chances to race
    predictor.reporter.start(interval_s=0.002)
    errors: list[BaseException] = []

    def route(t: int) -> None:
        try:
            for start in range(0, per_thread, chunk):
                predictor.observe(finished([f"t{t}-{i}" for i in
                                            range(start, start + chunk)]))
                predictor.predict(active(), 40)
        except BaseException as exc:  # pragma: no cover - the assertion reports it
            errors.append(exc)

    workers = [threading.Thread(target=route, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert predictor.reporter.running, "the reporter thread died"
    stats = predictor.close()
    total = threads * per_thread
    assert errors == []
    assert stats["sent"] == total and stats["duplicates"] == 0
    assert stats["dropped"] == stats["rejected"] == stats["pending"] == 0
    assert stored(url) - before == total


def test_background_thread_and_caller_flushes_never_send_a_batch_twice():
    """The same race at a counting server, with many more flushes."""
    with CountingService() as service:
        client = httpx.Client(base_url=service.url, timeout=5.0)
        reporter = ObservationReporter(client, batch_size=7)
        reporter.start(interval_s=0.001)
        total = 0

        def produce(t: int) -> None:
            for k in range(200):
                reporter.add(outcomes(f"p{t}-{k}-", 10))
                reporter.flush_due(force=True)

        workers = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        total = 4 * 200 * 10
        stats = reporter.stop()
        client.close()
    assert stats["sent"] == total and stats["dropped"] == 0
    assert len(service.ids) == total and max(service.ids.values()) == 1


def test_background_is_the_default_and_predict_never_waits_on_reports():
    """20,000 outcomes waiting and a service that takes 1 s per observations post: a
    predict() costs one contributions round trip, not the reports."""
    with CountingService(observations_delay_s=1.0) as service:
        predictor = HttpPredictor(service.url, timeout_s=0.5)
        predictor.reporter.batch_size = 5000  # 4 slow posts in all
        assert predictor.report == "background" and not predictor.flush_on_predict
        assert not predictor.reporter.running  # started lazily, at the first outcome
        predictor.observe(finished([f"w{i}" for i in range(20_000)]))
        assert predictor.reporter.running
        slowest = 0.0
        for _ in range(5):
            began = time.perf_counter()
            answer = predictor.predict(active(), 40)
            slowest = max(slowest, time.perf_counter() - began)
            assert answer.c_hat is not None
        assert slowest < 0.25, slowest
        stats = predictor.reporter.stop(timeout_s=60)
        predictor.close()
    assert stats["sent"] == 20_000 and len(service.ids) == 20_000


def test_invalid_outcomes_are_rejected_alone_before_sending(service_url, caplog):
    batch = outcomes("v", 1000)
    batch[10]["prompt_key"] = "k" * 300  # the finding of issue 12
    batch[20]["prompt_key"] = "bad\x00key"
    batch[30]["request_id"] = "x" * 129
    batch[40]["output_tokens"] = 1_048_577
    batch[50]["prompt_key"] = "lone \ud800 surrogate"
    batch[60]["finish_reason"] = "timeout"
    url = service_url
    before = stored(url)
    predictor = HttpPredictor(url, report="sync")
    with caplog.at_level(logging.ERROR, "balanceroute.reporter"):
        predictor.reporter.add(batch)
    assert predictor.reporter.rejected == 6 and predictor.reporter.pending() == 994
    assert "prompt_key must be a string of 1-256" in caplog.text
    assert predictor.reporter.flush_due() == 994
    stats = predictor.close()
    assert stored(url) - before == 994
    assert stats["sent"] == 994 and stats["dropped"] == 0


def test_a_batch_the_service_rejects_is_split_and_the_rest_delivered(service_url):
    """What slips through the local checks (a malformed ``completed_at``) gets a 422 for its
    whole batch: the reporter bisects the batch and drops only the bad outcome."""
    batch = outcomes("s", 1000)
    batch[617]["completed_at"] = "not a time"
    assert invalid_reason(batch[617]) is None  # not caught locally: the service decides
    url = service_url
    before = stored(url)
    predictor = HttpPredictor(url, report="sync")
    predictor.reporter.add(batch)
    assert predictor.reporter.flush_due() == 999
    assert predictor.reporter.rejected == 1 and predictor.reporter.pending() == 0
    stats = predictor.close()
    assert stored(url) - before == 999
    assert stats["sent"] == 999 and stats["dropped"] == 0 and stats["failures"] == 0


def test_a_wrong_token_is_a_configuration_error_not_an_endless_retry(tmp_path, caplog):
    env = {"BALANCEROUTE_API_TOKEN": "right"}
    with live_server(f"sqlite:///{tmp_path / 'auth.db'}", env=env) as url:
        predictor = HttpPredictor(url, report="sync", token="wrong")
        reporter = predictor.reporter
        with caplog.at_level(logging.ERROR, "balanceroute.reporter"):
            reporter.add(outcomes("a", 50))
            assert reporter.flush_due() == 0
        assert predictor.config_error is not None and "401" in predictor.config_error
        assert reporter.config_errors == 1 and reporter.dropped == 50 and reporter.pending() == 0
        assert any(r.levelno == logging.ERROR and "401" in r.getMessage()
                   for r in caplog.records)
        # no retry, now or later, and nothing piles up in the buffer
        reporter.add(outcomes("b", 10))
        assert reporter.pending() == 0 and reporter.dropped == 60
        assert reporter.flush_due(force=True) == 0 and reporter.config_errors == 1
        assert reporter.failures == 0
        stats = predictor.close()
        assert httpx.get(url + "/v1/status").json()["observations"] == 0
    assert stats["config_error"] and stats["sent"] == 0


def test_a_wrong_url_is_a_configuration_error_too():
    with CountingService(status=404) as service:
        predictor = HttpPredictor(service.url, report="sync")
        predictor.reporter.add(outcomes("u", 5))
        predictor.reporter.flush_due()
        predictor.reporter.flush_due(force=True)
        assert service.posts == 1 and "404" in (predictor.config_error or "")
        predictor.close()


def test_the_final_flush_reports_what_was_lost(caplog):
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    predictor = HttpPredictor(url, report="sync", timeout_s=0.2)
    predictor.reporter.add(outcomes("f", 12))
    with caplog.at_level(logging.INFO, "balanceroute.reporter"):
        stats = predictor.close()
    assert stats["sent"] == 0 and stats["dropped"] == 12 and stats["pending"] == 0
    line = [r for r in caplog.records if "reporter stopped" in r.getMessage()]
    assert line and line[0].levelno == logging.WARNING
    assert "0 delivered" in line[0].getMessage() and "12 dropped" in line[0].getMessage()
    assert predictor.close() == stats  # closing twice is harmless


def test_invalid_reason_cases():
    ok = {"request_id": "r", "output_tokens": 0, "prompt_tokens": 1_048_576,
          "prompt_key": "k" * 256, "finish_reason": "length"}
    assert invalid_reason(ok) is None
    for change in ({"request_id": ""}, {"output_tokens": -1}, {"output_tokens": True},
                   {"output_tokens": 2.5}, {"prompt_key": ""}, {"prompt": "a\x00b"},
                   {"request_id": 7}):
        assert invalid_reason({**ok, **change}) is not None, change
    assert invalid_reason({"request_id": "r"}) is not None  # output_tokens is required
    with pytest.raises(ValueError):
        HttpPredictor("http://127.0.0.1:1", report="sometimes")  # type: ignore[arg-type]
