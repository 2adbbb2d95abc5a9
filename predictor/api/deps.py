"""Dependencies shared by the routes, as ``Annotated`` aliases."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from ..abjobs import AbJobRunner
from ..metrics import Metrics
from ..service import PredictorService


def get_service(request: Request) -> PredictorService:
    return request.app.state.service


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def get_ab_jobs(request: Request) -> AbJobRunner:
    return request.app.state.ab_jobs


def require_token(request: Request) -> None:
    """Write endpoints: ``Authorization: Bearer <BALANCEROUTE_API_TOKEN>`` when one is set
    (compared in constant time)."""
    token = request.app.state.service.settings.api_token
    if not token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme != "Bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
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
