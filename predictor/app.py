"""The FastAPI app factory of the prediction service (API.md).

Settings and the engine are built in :func:`create_app`, not at import time, so that tests can
make one app per database.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Literal

import numpy as np
import orjson
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.background import BackgroundTask

from router_client.errors import TraceError
from router_client.traces import parse_trace

from .abjobs import AbJobRunner
from .metrics import Metrics
from .schemas import (
    CONTRIBUTIONS_IN,
    AbComparisonIn,
    AbJobOut,
    ContributionsIn,
    ContributionsOut,
    ObservationsIn,
    ObservationsOut,
    StatusOut,
    item_key,
)
from .service import PredictorService
from .settings import Settings
from .store import make_engine, ping

log = logging.getLogger("balanceroute.service")


def get_service(request: Request) -> PredictorService:
    return request.app.state.service


ServiceDep = Annotated[PredictorService, Depends(get_service)]


def require_token(request: Request) -> None:
    """Write endpoints: ``Authorization: Bearer <BALANCEROUTE_API_TOKEN>`` when one is set."""
    token = request.app.state.service.settings.api_token
    if not token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or given.strip() != token:
        raise HTTPException(status_code=401, detail="missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})


WriteAuth = Depends(require_token)


class BodyLimit:
    """ASGI middleware: 413 for a body over the limit, declared or streamed."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(send)
        received = 0
        chunks: list[dict] = []
        while True:  # read the whole body first, so an oversized stream stores nothing
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)
                break
            received += len(message.get("body", b""))
            if received > self.limit:
                return await self._reject(send)
            chunks.append(message)
            if not message.get("more_body", False):
                break

        async def replay():
            return chunks.pop(0) if chunks else await receive()

        return await self.app(scope, replay, send)

    async def _reject(self, send) -> None:
        body = json.dumps({"detail": f"request body over the limit of {self.limit} bytes"})
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body.encode()})


class RequestMetrics:
    """ASGI middleware: count requests and time them up to the last byte of the answer (not
    the background work after it), labelled by route template."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = 500
        observed = False

        def observe() -> None:
            nonlocal observed
            if observed:
                return
            observed = True
            endpoint = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(endpoint, scope["method"], str(status)).inc()
            self.metrics.latency.labels(endpoint, scope["method"]).observe(
                time.perf_counter() - started)

        async def send_and_observe(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                observe()

        try:
            await self.app(scope, receive, send_and_observe)
        finally:
            observe()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    engine = make_engine(settings.database_url)
    service = PredictorService(settings, engine)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.load()
        app.state.ab_jobs.recover()
        _refresh_gauges(service, metrics)
        # Everything loaded so far (modules, the learners' state) lives as long as the app:
        # move it out of the collector's sight. Without this every full collection walked the
        # whole heap, a ~60 ms pause every ~60 contribution queries (the P99).
        gc.collect()
        gc.freeze()
        log.info("loaded %d observations, model version %d", service.observations,
                 service.model_version)
        yield
        app.state.ab_jobs.shutdown()
        engine.dispose()

    app = FastAPI(
        title="BalanceRoute prediction service",
        version="0.1.0",
        description="Expected capped remaining life of active LLM requests, learned online "
        "from finished requests (Kaplan-Meier with censoring; ExactMatch per prompt key).",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.metrics = metrics
    app.state.ab_jobs = AbJobRunner(service.sessions)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)

    app.add_middleware(RequestMetrics, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Never echo inputs back: a prompt's text must not leave the request.
        errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")}
                  for e in exc.errors()]
        return JSONResponse(status_code=422, content={"detail": errors})

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse(status_code=503, content={"detail": "service error; retry later"})

    @app.post("/v1/observations", response_model=ObservationsOut, tags=["learning"],
              dependencies=[WriteAuth])
    def post_observations(body: ObservationsIn, service: ServiceDep) -> ObservationsOut:
        """Learn from finished requests; idempotent on ``request_id``; all or nothing."""
        limit = service.settings.max_observations_per_batch
        if len(body.observations) > limit:
            raise HTTPException(413, f"{len(body.observations)} observations; at most {limit} "
                                "per batch")
        result = service.ingest([{**o.model_dump(exclude={"prompt"}), "prompt_key": o.key()}
                                 for o in body.observations])
        metrics.ingested.inc(result.accepted)
        metrics.duplicates.inc(result.duplicates)
        _refresh_gauges(service, metrics)
        return ObservationsOut(accepted=result.accepted, duplicates=result.duplicates)

    @app.post("/v1/contributions", response_model=ContributionsOut, tags=["prediction"],
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": {
                      "$ref": "#/components/schemas/ContributionsIn"}}}}})
    async def post_contributions(request: Request, service: ServiceDep) -> Response:
        """Expected capped remaining life ``c_hat`` of each active request, in order.

        The body is validated straight from its bytes (hot path: a router asks every few
        decode steps for hundreds of requests); errors are the usual 422 with locations.
        """
        try:
            body = CONTRIBUTIONS_IN.validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
            ) from None
        return await run_in_threadpool(_contributions, body, service)

    def _contributions(body: ContributionsIn, service: PredictorService) -> Response:
        limit = service.settings.max_items_per_query
        items = body["items"]
        if len(items) > limit:
            raise HTTPException(413, f"{len(items)} items; at most {limit} per query")
        horizon = body.get("horizon") or service.settings.default_horizon
        generated = np.fromiter((i["generated_tokens"] for i in items), np.int64, len(items))
        keys = [item_key(i) for i in items]
        answer = service.contributions(generated, keys, horizon, body.get("estimator", "auto"))
        for name in set(answer.estimator):
            metrics.items.labels(name).inc(answer.estimator.count(name))
        metrics.hit_rate.set(service.learner.hit_rate_)
        mu = [None if m != m else m for m in answer.mu_rem.tolist()]  # NaN -> null
        payload = {
            "horizon": horizon, "model_version": answer.model_version,
            "drifted": answer.drifted,
            "items": [
                {"request_id": item["request_id"], "c_hat": c, "p_fin": p, "mu_rem": m,
                 "estimator": e, "support": s}
                for item, c, p, m, e, s in zip(items, answer.c_hat.tolist(),
                                               answer.p_fin.tolist(), mu, answer.estimator,
                                               answer.support.tolist(), strict=True)
            ],
        }
        # Calibration sampling runs after the answer is sent: off the router's latency path.
        record = BackgroundTask(service.record, [i["request_id"] for i in items], generated,
                                keys, horizon)
        return Response(orjson.dumps(payload), media_type="application/json", background=record)

    @app.post("/v1/ab-comparisons", status_code=202, tags=["a/b"], dependencies=[WriteAuth])
    def start_ab_comparison(body: AbComparisonIn, service: ServiceDep) -> dict:
        """Start a simulated A/B comparison (background job); poll it by id."""
        trace = None
        if body.trace is not None:
            try:  # a bad trace is the caller's error, reported now with its line
                trace = parse_trace(body.trace.content, body.trace.format, "trace")
            except TraceError as exc:
                raise RequestValidationError([{"loc": ("body", "trace", "content"),
                                               "msg": str(exc), "type": "trace_format"}]
                                             ) from None
            trace = trace.head(body.requests)
        return {"id": app.state.ab_jobs.submit(body.model_dump(), trace)}

    @app.get("/v1/ab-comparisons/{job_id}", response_model=AbJobOut, tags=["a/b"])
    def get_ab_comparison(job_id: str) -> dict:
        job = app.state.ab_jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no A/B comparison {job_id!r}")
        return job

    @app.get("/v1/status", response_model=StatusOut, tags=["service"])
    def status(service: ServiceDep) -> StatusOut:
        return StatusOut(model_version=service.model_version, observations=service.observations,
                         buckets=service.buckets, drifted=service.drift.drifted,
                         uptime_s=round(service.uptime_s, 3))

    @app.get("/v1/calibration", tags=["calibration"])
    def calibration(service: ServiceDep,
                    horizon: Annotated[int | None, Query(ge=1, le=4096)] = None,
                    estimator: Annotated[Literal["survival", "exact_match"] | None,
                                         Query()] = None,
                    window: Annotated[int | None, Query(ge=1)] = None) -> dict:
        """How good the issued predictions were: per estimator, scored on the same traffic."""
        report = service.calibration(horizon, estimator, window)
        _refresh_calibration_gauges(report, metrics)
        return report

    @app.get("/v1/calibration.png", tags=["calibration"],
             responses={200: {"content": {"image/png": {}}}})
    def calibration_png(service: ServiceDep,
                        horizon: Annotated[int | None, Query(ge=1, le=4096)] = None,
                        estimator: Annotated[Literal["survival", "exact_match"] | None,
                                             Query()] = None,
                        window: Annotated[int | None, Query(ge=1)] = None) -> Response:
        """The reliability diagram of the same data."""
        from .plots import reliability_png  # matplotlib only when a diagram is asked for

        report = service.calibration(horizon, estimator, window)
        return Response(reliability_png(report), media_type="image/png")

    @app.get("/healthz", tags=["service"])
    def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", tags=["service"])
    def readyz(service: ServiceDep) -> JSONResponse:
        checks = {"learner_loaded": service.loaded}
        try:
            with service.session() as session:
                checks["database"] = ping(session=session)
        except Exception as exc:  # any driver error means "not ready", never a 500
            log.warning("readiness: database unreachable: %s", exc)
            checks["database"] = False
        ready = all(checks.values())
        return JSONResponse(status_code=200 if ready else 503,
                            content={"status": "ready" if ready else "not ready", **checks})

    @app.get("/metrics", tags=["service"])
    def prometheus_metrics() -> Response:
        _refresh_gauges(service, metrics)
        _refresh_calibration_gauges(service.calibration(), metrics)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            body = CONTRIBUTIONS_IN.json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(body.pop("$defs", {}))
            components["ContributionsIn"] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _refresh_gauges(service: PredictorService, metrics: Metrics) -> None:
    metrics.buckets.set(service.buckets)
    metrics.model_version.set(service.model_version)
    metrics.observations.set(service.observations)
    metrics.hit_rate.set(service.learner.hit_rate_)
    metrics.drifted.set(1.0 if service.drift.drifted else 0.0)


def _refresh_calibration_gauges(report: dict, metrics: Metrics) -> None:
    if report["horizon"] is not None or report["window"] is not None:
        return  # gauges describe the unfiltered report
    for entry in report["estimators"]:
        if entry["scored"]:
            metrics.ece.labels(entry["estimator"]).set(entry["ece"])
            metrics.brier.labels(entry["estimator"]).set(entry["brier"])
