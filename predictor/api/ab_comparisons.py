"""``/v1/ab-comparisons``: simulated A/B comparisons as background jobs."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError

from router_client.errors import TraceError
from router_client.traces import Trace, parse_trace_head

from ..abjobs import TooManyJobs
from ..schemas import MAX_TOKENS, AbComparisonIn, AbJobCreated, AbJobOut
from .deps import NOT_FOUND, TOO_LARGE, UNAUTHORIZED, AbJobsDep, WriteAuth, job_or_404

router = APIRouter(prefix="/v1/ab-comparisons", tags=["a/b"])

MAX_TRACE_REQUESTS = 200_000


def _invalid(loc: tuple, message: str, kind: str) -> RequestValidationError:
    return RequestValidationError([{"loc": loc, "msg": message, "type": kind}])


def parsed_trace(body: AbComparisonIn) -> Trace | None:
    """The request's trace, parsed and checked against the limits (422 naming the problem)."""
    if body.trace is None:
        return None
    loc = ("body", "trace", "content")
    keep = body.requests or MAX_TRACE_REQUESTS + 1  # rows past these are not even parsed
    try:  # a bad trace is the caller's error, reported now with its line
        trace = parse_trace_head(body.trace.content, body.trace.format, "trace", keep)
    except TraceError as exc:
        raise _invalid(loc, str(exc), "trace_format") from None
    if len(trace) > MAX_TRACE_REQUESTS:
        raise _invalid(loc, f"more than {MAX_TRACE_REQUESTS} requests; at most "
                       f"{MAX_TRACE_REQUESTS} (requests keeps the first ones)", "too_long")
    longest = max(int(trace.output_tokens.max()), int(trace.prompt_tokens.max()))
    if longest > MAX_TOKENS:
        raise _invalid(loc, f"a request of {longest} tokens; at most {MAX_TOKENS}", "too_large")
    problem = None if body.warm_requests is None else trace.split_problem(body.warm_requests)
    if problem is not None:
        raise _invalid(("body", "warm_requests"), problem, "too_large")
    return trace


@router.post("", status_code=202, response_model=AbJobCreated, dependencies=[WriteAuth],
             responses={**TOO_LARGE, **UNAUTHORIZED})
async def start_ab_comparison(request: Request, body: AbComparisonIn,
                              jobs: AbJobsDep) -> AbJobCreated:
    """Start a simulated A/B comparison (background job); poll it by id."""
    try:
        await run_in_threadpool(jobs.check_room)  # before the trace is parsed, not after
        # a trace's rows take several times its text while they are parsed: at most
        # INGEST_CONCURRENCY bodies (traces, observations) are parsed at once
        async with request.app.state.ingest_slots:
            trace = await run_in_threadpool(parsed_trace, body)
        job_id = await run_in_threadpool(jobs.submit, body.model_dump(), trace, "ab")
    except TooManyJobs as exc:
        raise _invalid(("body",), str(exc), "too_many_jobs") from None
    return AbJobCreated(id=job_id)


@router.get("", response_model=list[AbJobOut])
def list_ab_comparisons(jobs: AbJobsDep) -> list[dict]:
    """The newest 100 comparisons, without their results."""
    return jobs.list("ab")


@router.get("/{job_id}", response_model=AbJobOut, responses=NOT_FOUND)
def get_ab_comparison(job_id: str, jobs: AbJobsDep) -> dict:
    """A job's status, progress and, when done, its result rows."""
    return job_or_404(jobs.get(job_id, "ab"), "A/B comparison", job_id)


@router.delete("/{job_id}", response_model=AbJobOut, dependencies=[WriteAuth],
                responses={**NOT_FOUND, **UNAUTHORIZED})
def cancel_ab_comparison(job_id: str, jobs: AbJobsDep) -> dict:
    """Cancel a queued or running comparison (status ``cancelled``; a running one stops at
    its next progress report)."""
    return job_or_404(jobs.cancel(job_id, "ab"), "A/B comparison", job_id)
