"""Dependencies shared by the routes, as ``Annotated`` aliases.

They are ``async def``: each only reads the app's state or a header, and FastAPI runs a plain
``def`` dependency on a worker thread, two thread hand-offs per request for nothing (about
half of a 1-item ``/v1/contributions`` call's time in the service)."""

from __future__ import annotations

import hmac
import json
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from ..abjobs import AbJobRunner
from ..metrics import Metrics
from ..service import PredictorService

Responses = dict[int | str, dict[str, Any]]


def _error(description: str) -> dict[str, Any]:
    """An error answer in the OpenAPI document: ``{"detail": "..."}``."""
    return {"description": description, "content": {"application/json": {"schema": {
        "type": "object", "properties": {"detail": {"type": "string"}},
        "required": ["detail"]}}}}


NOT_FOUND: Responses = {404: _error("no job with this id (of this kind)")}
TOO_LARGE: Responses = {413: _error("more entries than the per-request limit, or a body past "
                         "MAX_BODY_BYTES")}
INVALID: Responses = {422: {"description": "Validation Error", "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/HTTPValidationError"}}}}}
UNAUTHORIZED: Responses = {401: _error("missing or wrong bearer token (API_TOKEN is set)")}


def body_schema(name: str) -> dict[str, Any]:
    """``openapi_extra`` documenting the JSON body of a route that reads it itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "$ref": f"#/components/schemas/{name}"}}}}}


def invalid_body(exc: ValidationError) -> RequestValidationError:
    """A body's validation errors as FastAPI words them (located under ``body``)."""
    return RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()])


def unreadable(cause: BaseException | None) -> str:
    """Why a body that is JSON text by its syntax could not be decoded, in words."""
    if isinstance(cause, RecursionError):
        return "nested too deeply"
    if isinstance(cause, UnicodeDecodeError):
        return "not UTF-8 text"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "a number with too many digits"
    return "unreadable"


def says_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this content type as JSON: none given,
    ``application/json`` or ``application/*+json``, whatever the case and parameters."""
    if not content_type:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))


def json_body(raw: bytes, content_type: str | None) -> Any:
    """A route's JSON body decoded as FastAPI decodes it, refused with the errors the app's
    handlers give FastAPI's own: a missing body, a content type that is not JSON, JSON
    syntax (at its position), and JSON text that cannot be decoded (the reason named)."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "Field required", "input": None}])
    if not says_json(content_type):
        raise RequestValidationError([{
            "loc": ("body",), "type": "content_type",
            "msg": "send the body as JSON with content-type: application/json "
                   f"(this request's: {content_type})"}])
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos),
                                       "msg": "JSON decode error", "input": {},
                                       "ctx": {"error": exc.msg}}]) from None
    except (ValueError, RecursionError) as exc:
        raise RequestValidationError([{"loc": ("body",), "type": "json_invalid",
                                       "msg": f"JSON decode error: {unreadable(exc)}"}]) from None


async def get_service(request: Request) -> PredictorService:
    return request.app.state.service


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


async def get_ab_jobs(request: Request) -> AbJobRunner:
    return request.app.state.ab_jobs


def token_ok(header: str, token: str | None) -> bool:
    """``header`` (the Authorization header) is ``Bearer <token>``, compared in constant time;
    anything goes when no token is set."""
    if not token:
        return True
    scheme, _, given = header.partition(" ")
    return scheme == "Bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def require_token(request: Request) -> None:
    """Write endpoints: ``Authorization: Bearer <BALANCEROUTE_API_TOKEN>`` when one is set
    (compared in constant time). The app's ``TokenGate`` checks it before the body is read;
    this dependency also marks the routes in the OpenAPI schema."""
    token = request.app.state.service.settings.api_token
    if not token_ok(request.headers.get("authorization", ""), token):
        raise HTTPException(status_code=401, detail="missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})


ServiceDep = Annotated[PredictorService, Depends(get_service)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
AbJobsDep = Annotated[AbJobRunner, Depends(get_ab_jobs)]
WriteAuth = Depends(require_token)


def job_or_404(job: dict | None, what: str, job_id: str) -> dict:
    """A job's answer, or 404 naming what was looked for."""
    if job is None:
        raise HTTPException(404, f"no {what} {job_id!r}")
    return job
