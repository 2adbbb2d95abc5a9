"""A/B comparisons as background jobs of the service (``/v1/ab-comparisons``).

Jobs run one at a time on a worker thread (a replay is CPU-bound; two at once would only share
the cores) with the same composition as ``balanceroute ab``: the same data, parameters and
seed give the same rows. Jobs and their results are rows of ``ab_jobs``; a job that was queued
or running when the process stopped is marked failed ("interrupted") at the next start.
"""

from __future__ import annotations

import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import numpy as np
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from models import AbJob, Observation
from router_client.admission import BalanceRouteParams
from router_client.errors import TraceError
from router_client.simulator import DEFAULT_STEP_COST, SimConfig
from router_client.traces import Trace

from . import abtest

log = logging.getLogger("balanceroute.ab")


def trace_from_observations(session: Session, requests: int | None) -> Trace:
    """The service's stored observations as a trace: arrivals in completion order; an unknown
    prompt length is replayed as the median of the known ones."""
    query = (select(Observation.completed_at, Observation.prompt_tokens,
                    Observation.output_tokens, Observation.censored, Observation.prompt_key)
             .where(Observation.output_tokens > 0)
             .order_by(Observation.completed_at, Observation.id))
    if requests:
        query = query.limit(requests)
    rows = session.execute(query).all()
    if not rows:
        raise TraceError("observations", "the service has no stored observations to replay")
    stamps = np.asarray([(r[0] if r[0].tzinfo else r[0].replace(tzinfo=UTC)).timestamp()
                         for r in rows])
    # An observation reported without its prompt length replays with the median known one.
    known = [r[1] for r in rows if r[1] is not None]
    typical = int(np.median(known)) if known else 0
    prompts = np.asarray([typical if r[1] is None else r[1] for r in rows], dtype=np.int64)
    return Trace("observations", prompts,
                 np.asarray([r[2] for r in rows], dtype=np.int64),
                 np.asarray([r[3] for r in rows], dtype=bool), [r[4] for r in rows],
                 stamps - stamps[0])


class AbJobRunner:
    def __init__(self, sessions: sessionmaker) -> None:
        self.sessions = sessions
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ab-job")

    def recover(self) -> None:
        with self.sessions() as session:
            session.execute(update(AbJob).where(AbJob.status.in_(("queued", "running")))
                            .values(status="failed", error="interrupted by a service restart",
                                    updated_at=datetime.now(UTC)))
            session.commit()

    def submit(self, request: dict, trace: Trace | None = None) -> str:
        """Queue a job. ``trace`` is the request's parsed trace (the caller parsed it to
        validate it); without one the job replays the stored observations."""
        job_id = uuid.uuid4().hex
        now = datetime.now(UTC)
        with self.sessions() as session:
            session.add(AbJob(id=job_id, status="queued", progress=0.0,
                              request=json.dumps(request), created_at=now, updated_at=now))
            session.commit()
        self.executor.submit(self._run, job_id, request, trace)
        return job_id

    def get(self, job_id: str) -> dict | None:
        with self.sessions() as session:
            job = session.get(AbJob, job_id)
            if job is None:
                return None
            return {"id": job.id, "status": job.status, "progress": job.progress,
                    "results": json.loads(job.results) if job.results else [],
                    "error": job.error, "created_at": job.created_at.isoformat(),
                    "request": json.loads(job.request)}

    def _set(self, job_id: str, **values) -> None:
        with self.sessions() as session:
            session.execute(update(AbJob).where(AbJob.id == job_id)
                            .values(updated_at=datetime.now(UTC), **values))
            session.commit()

    def _run(self, job_id: str, request: dict, trace: Trace | None) -> None:
        self._set(job_id, status="running")
        last = [0.0]

        def progress(fraction: float, label: str) -> None:
            if fraction - last[0] >= 0.02 or fraction >= 1.0:
                last[0] = fraction
                self._set(job_id, progress=round(min(fraction, 1.0), 4))

        try:
            if trace is None:
                with self.sessions() as session:
                    trace = trace_from_observations(session, request["requests"])
            config = SimConfig(batch=request["batch"], load=request["load"],
                               step_cost=tuple(request["step_cost"] or DEFAULT_STEP_COST),
                               horizon=request["horizon"],
                               refresh_steps=request["refresh_steps"], seed=request["seed"])
            comparison = abtest.run_comparison(
                trace, request["policies"], request["workers"], config, progress,
                params=BalanceRouteParams(stage1=request["stage1"]))
            self._set(job_id, status="done", progress=1.0,
                      results=json.dumps(comparison.rows))
        except Exception as exc:  # the job fails, the service does not
            log.exception("A/B job %s failed", job_id)
            self._set(job_id, status="failed", error=f"{type(exc).__name__}: {exc}")

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
