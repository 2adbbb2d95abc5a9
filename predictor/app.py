"""The FastAPI app factory of the prediction service (REST API in the README).

Settings and the engine are built in :func:`create_app`, not at import time, so that tests can
make one app per database.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from swagger_ui_bundle import swagger_ui_path

from .abjobs import AbJobRunner
from .api import ROUTERS
from .api.contributions import answer
from .api.contributions import router as contributions_router
from .api.deps import token_ok, unreadable
from .asgi import BodyLimit, body_budget, replay_body
from .metrics import Metrics, refresh_gauges
from .schemas import (
    CONTRIBUTIONS_IN,
    ObservationsIn,
    parse_contributions,
    unknown_field_errors,
)
from .service import PredictorService
from .settings import Settings
from .store import make_engine

log = logging.getLogger("balanceroute.service")


WRITE_PATHS = ("/v1/observations", "/v1/ab-comparisons", "/v1/tunings")
WRITE_METHODS = ("POST", "PUT", "PATCH", "DELETE")


class TokenGate:
    """ASGI middleware: a write (``WRITE_METHODS`` on ``WRITE_PATHS``) without the bearer
    token gets its 401 before a byte of its body is read or parsed."""

    def __init__(self, app, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or not self.token or scope["method"] not in WRITE_METHODS
                or not scope["path"].startswith(WRITE_PATHS)):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        if token_ok(header.decode("latin-1"), self.token):
            return await self.app(scope, receive, send)
        body = json.dumps({"detail": "missing or wrong bearer token"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


class RequestMetrics:
    """ASGI middleware: count requests and time them up to the last byte of the answer (not
    the background work after it), labelled by route template. A request answered before it
    was routed (a 401 of the token gate; a 413, 408 or budget 503 of :class:`BodyLimit`) is
    labelled by the route its path and method match in ``routes``, else by one its path
    matches (a method it does not take: the app would answer 405), ``unmatched`` if none."""

    def __init__(self, app, metrics: Metrics, routes: Sequence[BaseRoute] = ()) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def _route_of(self, scope) -> str:
        route = scope.get("route")
        if route is None:
            matches = [(r, r.matches(scope)[0]) for r in self.routes]
            route = next((r for r, m in matches if m is Match.FULL),
                         next((r for r, m in matches if m is Match.PARTIAL), None))
        return getattr(route, "path", "unmatched")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = 503  # an error that escapes: the app's handler answers it with 503
        observed = False

        def observe() -> None:
            nonlocal observed
            if observed:
                return
            observed = True
            endpoint = self._route_of(scope)
            self.metrics.requests.labels(endpoint, scope["method"], str(status)).inc()
            self.metrics.latency.labels(endpoint, scope["method"]).observe(
                time.perf_counter() - started)

        answered = False

        async def send_and_observe(message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status, answered = message["status"], True
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                observe()

        try:
            await self.app(scope, receive, send_and_observe)
            if not answered:
                status = 499  # the client left before an answer (nginx's code)
        finally:
            observe()


class ContributionsFastPath:
    """ASGI middleware: ``POST /v1/contributions`` answered straight from its handler, past
    FastAPI's exception, routing and dependency layers (the hot path, asked every few decode
    steps: 0.4-0.7 ms of a 1,024-item call). Only a success is answered here: a body that does
    not validate, or a query the handler refuses (413, 422), goes the regular way with its
    bytes replayed, so its error is exactly the route's; an unexpected error reaches the app's
    handler (503) as it would from the route. Inside :class:`BodyLimit` and the request
    metrics, which label it as the route. A small query is answered on the event loop itself
    while the learners are free (:data:`INLINE_ITEMS`), any other on the thread pool."""

    PATH = "/v1/contributions"

    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.PATH:
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, replay_body(chunks, message, receive), send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        scope["route"] = CONTRIBUTIONS_ROUTE  # the request metrics' label, as routed, even
        # for an unexpected error (the router sets it again where the route answers)
        try:
            body = parse_contributions(raw)
            client = scope.get("client")
            arguments = (body, self.state.service, self.state.metrics,
                         client[0] if client else "")
            response = (_answer_if_free(*arguments) if _items(body) <= INLINE_ITEMS else None)
            if response is None:
                response = await run_in_threadpool(answer, *arguments)
        except (ValidationError, RequestValidationError, HTTPException):
            return await self.app(scope, replay_body([raw], None, receive), send)
        await response(scope, receive, send)


CONTRIBUTIONS_ROUTE = contributions_router.routes[0]
# A query of at most this many requests is answered on the event loop itself when the
# learners are free (no hop to the thread pool and back: about a fifth of a small query's time
# in the service); a larger one, or one that comes while an ingestion or a fit holds the
# learners, on the thread pool, so that the loop never waits on the lock or on a long answer
# (2,048 requests: about 3 ms here).
INLINE_ITEMS = 2048


def _items(body) -> int:
    """The requests a contributions query asks about (the larger layout if it gives both:
    the answer refuses that anyway)."""
    columns = body.get("columns")
    return max(len(body.get("items") or ()),
               len(columns["request_id"]) if columns is not None else 0)


def _answer_if_free(body, service: PredictorService, metrics: Metrics,
                    caller: str) -> Response | None:
    """:func:`answer`, where the learners' lock is free at once; None where it is held."""
    if not service.lock.acquire(blocking=False):
        return None
    try:
        return answer(body, service, metrics, caller)
    finally:
        service.lock.release()


BODY_UNPARSED = "There was an error parsing the body"  # FastAPI's 400 detail
MAX_ERRORS_LISTED = 50  # in a 422 (the schemas keep a bad body's errors few: see schemas.py)


def _error_handlers(app: FastAPI) -> None:
    """422 for bad input (never echoing it), 503 for anything unexpected."""

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Never echo inputs back: a prompt's text must not leave the request.
        raw = exc.errors()
        errors = [{k: v for k, v in named.items() if k in ("loc", "msg", "type")}
                  for e in raw[:MAX_ERRORS_LISTED] for named in unknown_field_errors(e)]
        if len(raw) > MAX_ERRORS_LISTED:
            errors.append({"loc": ["body"], "type": "too_many_errors",
                           "msg": f"{len(raw) - MAX_ERRORS_LISTED} more errors, not listed"})
        if len(raw) == 1 and raw[0]["type"] == "model_attributes_type" and isinstance(
                raw[0].get("input"), bytes):  # FastAPI did not read the body as JSON
            # FastAPI reads the body as JSON only when the request says it is (curl -d sends
            # application/x-www-form-urlencoded): say so, not "a valid dictionary"
            kind = request.headers.get("content-type", "")
            errors = [{"loc": ["body"], "type": "content_type",
                       "msg": "send the body as JSON with content-type: application/json "
                              f"(this request's: {kind or 'none'})"}]
        return JSONResponse(status_code=422, content={"detail": errors})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400 and exc.detail == BODY_UNPARSED:
            # FastAPI's answer to a JSON body it could not decode for a reason other than a
            # syntax error: a 422 naming the reason, as for any other body that is not JSON
            return JSONResponse(status_code=422, content={"detail": [{
                "loc": ["body"], "type": "json_invalid",
                "msg": f"JSON decode error: {unreadable(exc.__cause__)}"}]})
        return await http_exception_handler(request, exc)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse(status_code=503, content={"detail": "service error; retry later"})


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    engine = make_engine(settings.database_url)
    service = PredictorService(settings, engine)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.load()
        service.start_tailing()
        app.state.ab_jobs.recover()
        service.recommendation = app.state.ab_jobs.latest_recommendation()
        refresh_gauges(service, metrics)
        # Everything loaded so far (modules, the learners' state) lives as long as the app:
        # move it out of the collector's sight. Without this every full collection walked the
        # whole heap, a ~60 ms pause every ~60 contribution queries (the P99).
        gc.collect()
        gc.freeze()
        log.info("loaded %d observations, model version %d", service.observations,
                 service.model_version)
        yield
        app.state.ab_jobs.shutdown()
        service.stop_tailing()
        service.fitter.shutdown(wait=False, cancel_futures=True)
        engine.dispose()

    app = FastAPI(
        title="BalanceRoute prediction service",
        version="0.1.0",
        description="Expected capped remaining life of active LLM requests, learned online "
        "from finished requests (Kaplan-Meier with censoring; ExactMatch per prompt key).",
        lifespan=lifespan,
        docs_url=None,  # served below from bundled assets: no CDN
        redoc_url=None,
    )
    app.state.service = service
    app.state.ingest_slots = asyncio.Semaphore(settings.ingest_concurrency)
    app.state.metrics = metrics
    app.state.png_cache = OrderedDict()  # reliability diagrams by (query, scored count)
    app.state.ab_jobs = AbJobRunner(service.sessions, settings.max_queued_jobs,
                                    on_tuned=lambda advice: setattr(service, "recommendation",
                                                                    advice))
    app.add_middleware(ContributionsFastPath, state=app.state)  # innermost: after the limits
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes,
                       budget=body_budget(settings.max_inflight_body_bytes,
                                          settings.max_body_bytes))
    app.add_middleware(TokenGate, token=settings.api_token)  # outside BodyLimit: checked first

    app.add_middleware(RequestMetrics, metrics=metrics,
                       routes=[route for router in ROUTERS for route in router.routes])

    _error_handlers(app)

    for router in ROUTERS:
        app.include_router(router)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            # the bodies the routes read themselves
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, adapter in (("ContributionsIn", CONTRIBUTIONS_IN),
                                  ("ObservationsIn", TypeAdapter(ObservationsIn))):
                body = adapter.json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[name] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    _self_hosted_docs(app)
    return app


DOCS_ASSETS = "/docs-assets"


def _self_hosted_docs(app: FastAPI) -> None:
    """``/docs``: Swagger UI from the ``swagger-ui-bundle`` package's files, served by the
    service itself, so the page works on a host without internet access."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=app.title + " - docs",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")
