"""``POST /v1/observations``: learn from finished requests."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from ..metrics import refresh_gauges
from ..schemas import ObservationsIn, ObservationsOut
from .deps import TOO_LARGE, UNAUTHORIZED, MetricsDep, ServiceDep, WriteAuth

router = APIRouter(prefix="/v1/observations", tags=["learning"])


@router.post("", response_model=ObservationsOut, dependencies=[WriteAuth],
             responses={**TOO_LARGE, **UNAUTHORIZED})
def post_observations(body: ObservationsIn, service: ServiceDep,
                      metrics: MetricsDep) -> ObservationsOut:
    """Learn from finished requests; idempotent on ``request_id``; all or nothing."""
    limit = service.settings.max_observations_per_batch
    if len(body.observations) > limit:
        raise HTTPException(413, f"{len(body.observations)} observations; at most {limit} "
                            "per batch")
    result = service.ingest([{**o.model_dump(exclude={"prompt"}), "prompt_key": o.key()}
                             for o in body.observations])
    metrics.ingested.inc(result.accepted)
    metrics.duplicates.inc(result.duplicates)
    refresh_gauges(service, metrics)
    return ObservationsOut(accepted=result.accepted, duplicates=result.duplicates)
