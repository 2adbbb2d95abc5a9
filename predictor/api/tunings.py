"""``/v1/tunings``: which policy this workload should run, from the service's own data."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.exceptions import RequestValidationError

from ..abjobs import TooManyJobs
from ..schemas import AbJobCreated, AbJobOut, TuningIn
from ..tuning import learners_of
from .deps import (
    NOT_FOUND,
    TOO_LARGE,
    UNAUTHORIZED,
    AbJobsDep,
    ServiceDep,
    WriteAuth,
    job_or_404,
)

router = APIRouter(prefix="/v1/tunings", tags=["tuning"])


@router.post("", status_code=202, response_model=AbJobCreated, dependencies=[WriteAuth],
             responses={**TOO_LARGE, **UNAUTHORIZED})
def start_tuning(body: TuningIn, jobs: AbJobsDep, service: ServiceDep) -> AbJobCreated:
    """Replay the most recent stored observations over BR-0 and a small BR-H grid; when
    done, the best setting becomes the service's recommendation (``/v1/status`` and every
    contributions answer), which routers adopt at their next refresh."""
    request = body.model_dump()
    if "estimator" not in body.model_fields_set and body.estimator not in service.estimators:
        request["estimator"] = service.auto  # the default left out: the service's own
    missing = [name for name in learners_of(request["estimator"])
               if name not in service.estimators]
    if missing:  # a router told to ask for it would get only errors
        raise RequestValidationError([{
            "loc": ("body", "estimator"), "type": "value_error",
            "msg": f"{', '.join(missing)}: not run by this service "
                   f"(BALANCEROUTE_ESTIMATORS; it runs {', '.join(service.estimators)}), so "
                   "routers could not ask it for a recommendation's predictions"}])
    try:
        return AbJobCreated(id=jobs.submit(request, None, kind="tuning"))
    except TooManyJobs as exc:
        raise RequestValidationError([{"loc": ("body",), "msg": str(exc),
                                       "type": "too_many_jobs"}]) from None


@router.get("", response_model=list[AbJobOut])
def list_tunings(jobs: AbJobsDep) -> list[dict]:
    return jobs.list("tuning")


@router.get("/{job_id}", response_model=AbJobOut, responses=NOT_FOUND)
def get_tuning(job_id: str, jobs: AbJobsDep) -> dict:
    """Status, progress and, when done, the ranked settings and the recommendation."""
    return job_or_404(jobs.get(job_id, "tuning"), "tuning", job_id)


@router.delete("/{job_id}", response_model=AbJobOut, dependencies=[WriteAuth],
                responses={**NOT_FOUND, **UNAUTHORIZED})
def cancel_tuning(job_id: str, jobs: AbJobsDep) -> dict:
    return job_or_404(jobs.cancel(job_id, "tuning"), "tuning", job_id)
