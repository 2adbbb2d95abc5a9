"""``balanceroute bench predictor``: contributions latency and ingestion throughput.

In process: ``PredictorService.contributions`` on ``items`` active requests (the learner
trained on 20,000 observations of ``synth:templated``, so ExactMatch and Survival both answer),
first right after the ingestion (``in_process``: the hazard model's fits of the last batches
still run on their thread), then once they are done (``in_process_fits_done``).
Over HTTP: the same query as JSON to a real uvicorn server on 127.0.0.1, one persistent
connection, as ``items`` (``http``) and as ``columns`` (``http_columns``, what
:class:`router_client.http_predictor.HttpPredictor` sends), alternated call by call: first right
after the ingestion below (the server's fits of those batches running), then once they are
done (``http_fits_done``, ``http_columns_fits_done``; ``/v1/status`` says ``fitting``).
Ingestion: batches of 1000 observations posted over HTTP, each answered only after its SQLite
commit.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from router_client.synth import synthesize

from .estimators import Features
from .livesrv import live_server
from .service import PredictorService
from .settings import Settings
from .store import make_engine


def _observations(n: int, offset: int, seed: int) -> list[dict]:
    trace = synthesize(f"synth:templated:n={n},seed={seed}")
    return [
        {"request_id": f"r{offset + i}", "prompt_key": trace.prompt_keys[i],
         "prompt_tokens": int(trace.prompt_tokens[i]), "output_tokens": int(trace.output_tokens[i]),
         "finish_reason": "length" if trace.censored[i] else "stop"}
        for i in range(n)
    ]


def _percentiles(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 4),
            "p99_ms": round(float(np.percentile(ms, 99)), 4),
            "mean_ms": round(float(ms.mean()), 4)}


def bench_predictor(items: int = 1024, rounds: int = 300, ingest_batches: int = 20) -> dict:
    import httpx

    rng = np.random.default_rng(0)
    query_trace = synthesize(f"synth:templated:n={items},seed=9")
    generated = rng.integers(0, 400, items)
    keys = list(query_trace.prompt_keys)
    query = [{"request_id": f"q{i}", "prompt_key": keys[i], "prompt_tokens": 1000,
              "generated_tokens": int(generated[i])} for i in range(items)]
    body = {"horizon": 80, "items": query}
    training = _observations(20000, 0, 1)
    result: dict = {"items": items, "rounds": rounds}
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        service = PredictorService(Settings(database_url=url), make_engine(url))
        service.load()
        started = time.perf_counter()
        for start in range(0, len(training), 1000):
            service.ingest(training[start:start + 1000])
        result["ingest_in_process_obs_per_s"] = round(len(training) /
                                                      (time.perf_counter() - started))
        # first as it comes, the hazard model's fits of the ingested batches still running on
        # their thread (sharing the interpreter); then once they are done
        result["in_process"] = _in_process_latencies(service, generated, keys, rounds)
        service.wait_for_fits()
        result["in_process_fits_done"] = _in_process_latencies(service, generated, keys, rounds)
        service.engine.dispose()

        http_url = f"sqlite:///{Path(tmp) / 'http.db'}"
        with live_server(http_url) as base, httpx.Client(base_url=base, timeout=30) as client:
            batches = [_observations(1000, 100000 + k * 1000, 100 + k)
                       for k in range(ingest_batches)]
            started = time.perf_counter()
            for batch in batches:
                client.post("/v1/observations", json={"observations": batch}).raise_for_status()
            elapsed = time.perf_counter() - started
            result["ingest_http_obs_per_s"] = round(ingest_batches * 1000 / elapsed)
            # the two layouts of the same query, alternated round by round (same conditions)
            columnar = {"horizon": 80, "columns": {
                field: [item[field] for item in query] for field in query[0]}}
            both = _contributions_latencies(client, [body, columnar], rounds)
            result["http"], result["http_columns"] = (_percentiles(both[0::2]),
                                                      _percentiles(both[1::2]))
            # again once the server's fits of those batches are done, as in process
            result["http_fits_wait_s"] = _wait_for_fits(client)
            both = _contributions_latencies(client, [body, columnar], rounds)
            result["http_fits_done"], result["http_columns_fits_done"] = (
                _percentiles(both[0::2]), _percentiles(both[1::2]))
            result.update(_contributions_while_ingesting(client, base, rounds))
    return result


def _in_process_latencies(service: PredictorService, generated: np.ndarray, keys: list,
                          rounds: int) -> dict:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        service.contributions(Features.of(generated, keys), 80)
        times.append(time.perf_counter() - t0)
    return _percentiles(times)


def _wait_for_fits(client, timeout_s: float = 300.0) -> float:
    """Poll ``/v1/status`` until the service has no model fit queued or running; the seconds
    waited (``TimeoutError`` past ``timeout_s``)."""
    started = time.perf_counter()
    while client.get("/v1/status").json()["fitting"]:
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"the service still fitting after {timeout_s:.0f} s")
        time.sleep(0.2)
    return round(time.perf_counter() - started, 1)


ONE_ITEM = {"horizon": 80, "items": [{"request_id": "one", "prompt_key": "k",
                                     "prompt_tokens": 1000, "generated_tokens": 10}]}


def _contributions_latencies(client, body: dict | list[dict], rounds: int) -> list[float]:
    """Seconds per ``/v1/contributions`` call, as a router makes it: encode, post, decode.
    With several bodies, each round posts each of them, starting with a different one each
    round (times listed in the bodies' order)."""
    times = []
    bodies = body if isinstance(body, list) else [body]
    for number in range(rounds):
        # each body first in turn (no ordering bias); times kept in the bodies' order
        order = [(number + k) % len(bodies) for k in range(len(bodies))]
        spent = [0.0] * len(bodies)
        for k in order:
            one = bodies[k]
            t0 = time.perf_counter()
            answer = client.post("/v1/contributions", content=orjson.dumps(one),
                                 headers={"content-type": "application/json"})
            answer.raise_for_status()
            orjson.loads(answer.content)
            spent[k] = time.perf_counter() - t0
        times.extend(spent)
    return times


def _contributions_while_ingesting(client, base: str, rounds: int) -> dict:
    """1-item contributions over HTTP, first alone, then while another client posts batches
    of 1000 observations back to back (each durably committed): queries must not wait on a
    commit. Same server, same run: compare the two."""
    import threading

    import httpx

    quiet = _percentiles(_contributions_latencies(client, ONE_ITEM, rounds))
    stop, posted = threading.Event(), [0]

    def ingest() -> None:
        with httpx.Client(base_url=base, timeout=30) as writer:
            k = 0
            while not stop.is_set():
                writer.post("/v1/observations", json={"observations": _observations(
                    1000, 500_000 + k * 1000, 1000 + k)}).raise_for_status()
                posted[0] += 1000
                k += 1

    thread = threading.Thread(target=ingest, daemon=True)
    thread.start()
    time.sleep(0.5)  # the writer is under way
    busy = _percentiles(_contributions_latencies(client, ONE_ITEM, rounds))
    stop.set()
    thread.join(timeout=60)
    return {"one_item_http": quiet, "one_item_http_while_ingesting": busy,
            "ingested_meanwhile": posted[0]}


def bench_calibration(scored: int = 100_000, rounds: int = 30) -> dict:
    """Time the calibration report (and its PNG) over ``scored`` stored scored predictions."""
    from .calibration import CalibrationTracker, Scored
    from .plots import reliability_png

    rng = np.random.default_rng(0)
    tracker = CalibrationTracker(["survival", "exact_match"], sample_rate=1.0, capacity=scored)
    p = rng.random(scored)
    ended = rng.random(scored) < p
    for i in range(scored):
        tracker.add_scored(Scored("survival" if i % 2 else "exact_match", 80 if i % 3 else 40,
                                  int(i % 500), float(p[i]), float(80 * (1 - p[i])),
                                  bool(ended[i]), float(rng.integers(1, 81)), bool(i % 5)))
    result: dict = {"scored": scored, "rounds": rounds}
    cases: tuple[tuple[str, dict[str, Any]], ...] = (
        ("report", {}), ("report_horizon_window", {"horizon": 80, "window": 10_000}))
    for label, kwargs in cases:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            tracker.report(**kwargs)
            times.append(time.perf_counter() - t0)
        result[label] = _percentiles(times)
    report = {"estimators": tracker.report(), "horizon": None, "drift": {"drifted": False}}
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        reliability_png(report)
        times.append(time.perf_counter() - t0)
    result["png"] = _percentiles(times)
    return result


def bench_restart(observations: int = 1_000_000, batch: int = 1000, keys: int = 20_000,
                  replay: int | None = None) -> dict:
    """Time a restart (``PredictorService.load``: migrations, replay, scored predictions) over
    a SQLite database holding ``observations`` stored observations in batches of ``batch``,
    with ``keys`` prompt keys: first without a snapshot of the per-key state (every older row
    scanned), then with the one a running service writes (``restart_s``).
    ``replay``: ``replay_observations`` (default: the setting's)."""
    from datetime import UTC, datetime

    from sqlalchemy import insert

    from models import Observation

    from .store import migrate

    rng = np.random.default_rng(0)
    now = datetime.now(UTC)
    result: dict[str, Any] = {"observations": observations, "keys": keys}
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'restart.db'}"
        engine = make_engine(url)
        migrate(engine)
        started = time.perf_counter()
        with engine.begin() as connection:
            for start in range(0, observations, batch):
                n = min(batch, observations - start)
                lengths = np.ceil(rng.lognormal(5.0, 1.0, n)).astype(int)
                key_ids = rng.integers(0, keys, n)
                connection.execute(insert(Observation), [
                    {"request_id": f"r{start + i}", "prompt_key": f"key-{key_ids[i]}",
                     "prompt_tokens": 500, "output_tokens": int(lengths[i]),
                     "finish_reason": "stop", "censored": False, "completed_at": now,
                     "batch": start // batch + 1} for i in range(n)])
        result["fill_s"] = round(time.perf_counter() - started, 1)
        engine.dispose()
        settings = Settings(database_url=url) if replay is None else Settings(
            database_url=url, replay_observations=replay)
        result["replay_observations"] = settings.replay_observations
        # the first start finds no snapshot and scans every older row; a running service then
        # writes one (on a background thread); a restart reads it
        service = _timed_load(settings, result, "restart_without_snapshot_s")
        started = time.perf_counter()
        result["snapshot_upto_id"] = service.write_snapshot()
        result["snapshot_write_s"] = round(time.perf_counter() - started, 2)
        service.engine.dispose()
        service = _timed_load(settings, result, "restart_s")
        result["learned_observations"] = service.observations
        result["buckets"] = service.buckets
        service.engine.dispose()
    return result


def _timed_load(settings: Settings, result: dict, label: str) -> PredictorService:
    service = PredictorService(settings, make_engine(settings.database_url))
    started = time.perf_counter()
    service.load()
    result[label] = round(time.perf_counter() - started, 2)
    return service
