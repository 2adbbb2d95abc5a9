"""Service endpoints: status, liveness, readiness, Prometheus metrics."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..metrics import refresh_calibration_gauges, refresh_gauges
from ..schemas import HealthOut, ReadyOut, StatusOut
from ..store import ping
from .deps import MetricsDep, ServiceDep

log = logging.getLogger("balanceroute.service")

router = APIRouter(tags=["service"])


@router.get("/v1/status", response_model=StatusOut)
def status(service: ServiceDep) -> StatusOut:
    return StatusOut(model_version=service.model_version, observations=service.observations,
                     buckets=service.buckets, drifted=service.drift.drifted,
                     uptime_s=round(service.uptime_s, 3), estimators=list(service.estimators),
                     auto_estimator=service.auto, recommendation=service.recommendation,
                     fitting=service.fitting)


@router.get("/healthz", response_model=HealthOut)
def healthz() -> HealthOut:
    """The process answers."""
    return HealthOut(status="ok")


@router.get("/readyz", response_model=ReadyOut, responses={503: {"model": ReadyOut}})
def readyz(service: ServiceDep) -> JSONResponse:
    """Database reachable and learners loaded (503 otherwise)."""
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


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def prometheus_metrics(service: ServiceDep, metrics: MetricsDep) -> Response:
    """Prometheus text format."""
    refresh_gauges(service, metrics)
    refresh_calibration_gauges(service.calibration(), metrics)
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
