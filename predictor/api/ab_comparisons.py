"""``/v1/ab-comparisons``: simulated A/B comparisons as background jobs."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from fastapi.exceptions import RequestValidationError

from router_client.errors import TraceError
from router_client.traces import parse_trace

from ..schemas import AbComparisonIn, AbJobCreated, AbJobOut
from .deps import AbJobsDep, WriteAuth

router = APIRouter(prefix="/v1/ab-comparisons", tags=["a/b"])


@router.post("", status_code=202, response_model=AbJobCreated, dependencies=[WriteAuth])
def start_ab_comparison(body: AbComparisonIn, jobs: AbJobsDep) -> AbJobCreated:
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
    return AbJobCreated(id=jobs.submit(body.model_dump(), trace))


@router.get("/{job_id}", response_model=AbJobOut)
def get_ab_comparison(job_id: str, jobs: AbJobsDep) -> dict:
    """A job's status, progress and, when done, its result rows."""
    job = jobs.get(job_id)
    if job is None:
        raise HTTPException(404, f"no A/B comparison {job_id!r}")
    return job
