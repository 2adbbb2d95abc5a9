"""``POST /v1/observations``: learn from finished requests."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from ..metrics import Metrics, refresh_gauges
from ..schemas import ObservationsIn, ObservationsOut
from ..service import PredictorService
from .deps import (
    INVALID,
    TOO_LARGE,
    UNAUTHORIZED,
    MetricsDep,
    ServiceDep,
    WriteAuth,
    body_schema,
    invalid_body,
    json_body,
)

router = APIRouter(prefix="/v1/observations", tags=["learning"])


@router.post("", response_model=ObservationsOut, dependencies=[WriteAuth],
             responses={**TOO_LARGE, **UNAUTHORIZED, **INVALID},
             openapi_extra=body_schema("ObservationsIn"))
async def post_observations(request: Request, service: ServiceDep,
                            metrics: MetricsDep) -> ObservationsOut:
    """Learn from finished requests; idempotent on ``request_id``; all or nothing."""
    # The body is read whole first (a slow sender holds no slot), then parsed, validated and
    # ingested at most INGEST_CONCURRENCY at a time: a parsed body takes 10-20 times its
    # bytes, and the ingestion is one at a time anyway (the learners' lock). The bodies that
    # wait are held as bytes, which the in-flight body budget bounds.
    raw = await request.body()
    async with request.app.state.ingest_slots:
        return await run_in_threadpool(_ingest, raw, request.headers.get("content-type"),
                                       service, metrics)


def _ingest(raw: bytes, content_type: str | None, service: PredictorService,
            metrics: Metrics) -> ObservationsOut:
    value = json_body(raw, content_type)
    limit = service.settings.max_observations_per_batch
    listed = value.get("observations") if isinstance(value, dict) else None
    if isinstance(listed, list) and len(listed) > limit:  # before a model is built of each
        raise HTTPException(413, f"{len(listed)} observations; at most {limit} per batch")
    try:
        body = ObservationsIn.model_validate(value)
    except ValidationError as exc:
        raise invalid_body(exc) from None
    del value, listed  # the Python objects of the JSON: 10-20 times its bytes
    result = service.ingest([{**o.model_dump(exclude={"prompt"}), "prompt_key": o.key()}
                             for o in body.observations])
    metrics.ingested.inc(result.accepted)
    metrics.duplicates.inc(result.duplicates)
    refresh_gauges(service, metrics)
    return ObservationsOut(accepted=result.accepted, duplicates=result.duplicates)
