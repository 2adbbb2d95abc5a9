"""Background jobs of the service: A/B comparisons (``/v1/ab-comparisons``) and tunings
(``/v1/tunings``).

Jobs run one at a time on a worker thread (a replay is CPU-bound; two at once would only share
the cores) with the same composition as ``balanceroute ab`` and ``balanceroute tune``: the same
data, parameters and seed give the same rows. Jobs and their results are rows of ``ab_jobs``
(``kind`` tells them apart); a trace given in the request is kept in memory for the job only
and never stored or returned. Each job is claimed by the replica that accepted it
(``owner``) with a lease (``lease_until``, ``LEASE_S`` seconds) that replica renews while it
lives; a job that was queued or running when its replica stopped is marked failed
("interrupted") once its lease runs out, by any replica (at start and every ``LEASE_S / 3``
seconds). Another replica's start leaves jobs with a live lease alone. ``cancel`` stops a
queued job before it starts and a running one at its next progress report (status ``cancelled``).

A done tuning's recommendation becomes the service's (``on_tuned``), and the newest one is
read back at start (:meth:`latest_recommendation`).
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import numpy as np
from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from models import AbJob, Observation
from router_client.admission import BalanceRouteParams
from router_client.errors import BalanceRouteError, ContractError, TraceError
from router_client.simulator import DEFAULT_STEP_COST, SimConfig
from router_client.traces import Trace

from . import abtest

log = logging.getLogger("balanceroute.ab")

ACTIVE = ("queued", "running")
LEASE_S = 30.0  # seconds a replica's claim on a job holds without renewal


class JobCancelled(BalanceRouteError):
    """Raised inside a job's progress callback once the job is cancelled."""


class TooManyJobs(BalanceRouteError):
    """The queue of jobs is full."""


def trace_from_observations(session: Session, requests: int | None,
                            recent: bool = False) -> Trace:
    """The service's stored observations as a trace: arrivals in completion order; an unknown
    prompt length is replayed as the median of the known ones. ``recent``: the latest
    ``requests`` observations instead of the first."""
    order = (Observation.completed_at.desc(), Observation.id.desc()) if recent else (
        Observation.completed_at, Observation.id)
    query = (select(Observation.completed_at, Observation.prompt_tokens,
                    Observation.output_tokens, Observation.censored, Observation.prompt_key)
             .where(Observation.output_tokens > 0).order_by(*order))
    if requests:
        query = query.limit(requests)
    rows = list(session.execute(query).all())
    if recent:
        rows.reverse()
    if not rows:
        raise TraceError("observations", "the service has no stored observations to replay")
    stamps = np.asarray([(r[0] if r[0].tzinfo else r[0].replace(tzinfo=UTC)).timestamp()
                         for r in rows])
    known = [r[1] for r in rows if r[1] is not None]
    typical = int(np.median(known)) if known else 0
    prompts = np.asarray([typical if r[1] is None else r[1] for r in rows], dtype=np.int64)
    return Trace("observations", prompts,
                 np.asarray([r[2] for r in rows], dtype=np.int64),
                 np.asarray([r[3] for r in rows], dtype=bool), [r[4] for r in rows],
                 stamps - stamps[0])


def _config(request: dict) -> SimConfig:
    return SimConfig(batch=request["batch"], load=request["load"],
                     step_cost=tuple(request["step_cost"] or DEFAULT_STEP_COST),
                     horizon=request.get("horizon") or 80,
                     refresh_steps=request["refresh_steps"], seed=request["seed"])


# BalanceRouteParams fields the REST job takes that jobs stored before they existed lack:
# such a job runs them at their defaults.
_LATER_OPTIONS = ("short_pool_growth", "zero_gamma_rules", "myopic_horizon", "own_wait_horizon",
                  "own_wait_learned", "br0_check", "learned_beta_scale", "learned_short_pool",
                  "marginal_overflow", "stage2_revisit")


def run_ab(request: dict, trace: Trace, progress) -> list[dict]:
    warm = None
    if request.get("warm_requests"):  # absent or null: no past, learners start empty
        warm, trace = trace.split(request["warm_requests"], "warm_requests")
    comparison = abtest.run_comparison(
        trace, request["policies"], request["workers"], _config(request), progress,
        params=BalanceRouteParams(stage1=request["stage1"],
                                  short_pool=request["short_pool"],
                                  stage2_order=request["stage2_order"],
                                  stage2_fill=request["stage2_fill"],
                                  guard=request.get("guard"),
                                  patience=request.get("patience"),
                                  **{name: request.get(name, getattr(BalanceRouteParams, name))
                                     for name in _LATER_OPTIONS}),
        warm=warm)
    return comparison.rows


def run_tuning(request: dict, trace: Trace, progress) -> dict:
    from .tuning import DEFAULT_GRID, parse_grid, tune

    grid = parse_grid(request["grid"]) if request.get("grid") else DEFAULT_GRID
    config = _config(request)
    result = tune(trace, replace(config, workers=request["workers"][0]),
                  estimator=request["estimator"], grid=grid, min_gain=request["min_gain"],
                  progress=progress, confirm=request.get("confirm", False))
    return result.as_dict(rest=True)


class AbJobRunner:
    def __init__(self, sessions: sessionmaker, max_queued: int = 8,
                 on_tuned: Callable[[dict], None] | None = None,
                 lease_s: float = LEASE_S) -> None:
        self.sessions = sessions
        self.max_queued = max_queued
        self.on_tuned = on_tuned
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ab-job")
        self.cancelled: set[str] = set()
        self.lock = threading.Lock()
        self.owner = uuid.uuid4().hex  # this replica (this process), the jobs' claimant
        self.lease_s = lease_s
        self._stop = threading.Event()
        self._heart: threading.Thread | None = None

    def _lease(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=self.lease_s)

    def recover(self) -> None:
        """Fail the active jobs whose replica is gone (their lease ran out, or they predate
        leases); jobs another live replica holds are left alone. Then keep this replica's
        leases renewed (every third of ``lease_s``) and sweep for lost jobs as often."""
        self.sweep()
        if self._heart is None:
            self._heart = threading.Thread(target=self._beat, name="ab-job-lease",
                                           daemon=True)
            self._heart.start()

    def sweep(self) -> int:
        now = datetime.now(UTC)
        with self.sessions() as session:
            lost = session.execute(
                update(AbJob).where(AbJob.status.in_(ACTIVE),
                                    or_(AbJob.lease_until.is_(None), AbJob.lease_until < now))
                .values(status="failed", updated_at=now,
                        error="interrupted: the replica running it stopped (service restart)"))
            session.commit()
        return int(getattr(lost, "rowcount", 0) or 0)

    def renew(self) -> None:
        with self.sessions() as session:
            session.execute(update(AbJob).where(AbJob.owner == self.owner,
                                                AbJob.status.in_(ACTIVE))
                            .values(lease_until=self._lease()))
            session.commit()

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.renew()
                self.sweep()
            except Exception:  # the database is away: try again at the next beat
                log.warning("renewing the A/B job leases failed", exc_info=True)

    def latest_recommendation(self) -> dict | None:
        with self.sessions() as session:
            results = session.scalar(
                select(AbJob.results).where(AbJob.kind == "tuning", AbJob.status == "done")
                .order_by(AbJob.updated_at.desc()).limit(1))
        return json.loads(results)["recommendation"] if results else None

    def submit(self, request: dict, trace: Trace | None = None, kind: str = "ab") -> str:
        """Queue a job. ``trace`` is the request's parsed trace (the caller parsed it to
        validate it); without one the job replays the stored observations."""
        job_id = uuid.uuid4().hex
        now = datetime.now(UTC)
        stored = dict(request)
        if stored.get("trace") is not None:  # never stored nor returned: the job has it
            stored["trace"] = {"format": stored["trace"]["format"],
                               "bytes": len(stored["trace"]["content"].encode())}
        with self.lock, self.sessions() as session:
            self._check_room(session)
            session.add(AbJob(id=job_id, kind=kind, status="queued", progress=0.0,
                              request=json.dumps(stored), created_at=now, updated_at=now,
                              owner=self.owner, lease_until=self._lease()))
            session.commit()
        # the job keeps the parsed trace, not its text (up to MAX_BODY_BYTES per queued job)
        self.executor.submit(self._run, job_id, kind, stored, trace)
        return job_id

    def check_room(self) -> None:
        """Raise :class:`TooManyJobs` if a job submitted now would be refused (a caller with
        costly work before :meth:`submit`, parsing a trace, asks first; ``submit`` checks
        again)."""
        with self.sessions() as session:
            self._check_room(session)

    def _check_room(self, session) -> None:
        queued = session.scalar(select(func.count()).select_from(AbJob)
                                .where(AbJob.status.in_(ACTIVE))) or 0
        if queued >= self.max_queued:
            raise TooManyJobs(f"{queued} jobs queued or running; at most {self.max_queued}")

    def get(self, job_id: str, kind: str = "ab") -> dict | None:
        with self.sessions() as session:
            job = session.get(AbJob, job_id)
            if job is None or job.kind != kind:
                return None
            return self._out(job, with_results=True)

    def list(self, kind: str = "ab", limit: int = 100) -> list[dict]:
        with self.sessions() as session:
            jobs = session.scalars(select(AbJob).where(AbJob.kind == kind)
                                   .order_by(AbJob.created_at.desc()).limit(limit))
            return [self._out(job, with_results=False) for job in jobs]

    def cancel(self, job_id: str, kind: str = "ab") -> dict | None:
        with self.sessions() as session:
            job = session.get(AbJob, job_id)
            if job is None or job.kind != kind:
                return None
            if job.status in ACTIVE:
                self.cancelled.add(job_id)
                if job.status == "queued":
                    self._set(job_id, status="cancelled")
        return self.get(job_id, kind)

    @staticmethod
    def _out(job: AbJob, with_results: bool) -> dict:
        results = json.loads(job.results) if (with_results and job.results) else None
        return {"id": job.id, "status": job.status, "progress": job.progress,
                "results": results if results is not None else [],
                "error": job.error, "created_at": job.created_at.isoformat(),
                "request": json.loads(job.request)}

    def _set(self, job_id: str, **values) -> None:
        with self.sessions() as session:
            session.execute(update(AbJob).where(AbJob.id == job_id)
                            .values(updated_at=datetime.now(UTC), **values))
            session.commit()

    def _run(self, job_id: str, kind: str, request: dict, trace: Trace | None) -> None:
        if job_id in self.cancelled:
            return
        self._set(job_id, status="running")
        last = [0.0]

        def progress(fraction: float, label: str) -> None:
            if job_id in self.cancelled:
                raise JobCancelled(job_id)
            if fraction - last[0] >= 0.02 or fraction >= 1.0:
                last[0] = fraction
                self._set(job_id, progress=round(min(fraction, 1.0), 4))

        try:
            if trace is None:
                with self.sessions() as session:
                    trace = trace_from_observations(session, request["requests"],
                                                    recent=kind == "tuning")
            if kind == "tuning":
                result: object = run_tuning(request, trace, progress)
            else:
                result = run_ab(request, trace, progress)
            self._set(job_id, status="done", progress=1.0, results=json.dumps(result))
            if kind == "tuning" and self.on_tuned is not None and isinstance(result, dict):
                self.on_tuned(result["recommendation"])
        except JobCancelled:
            self._set(job_id, status="cancelled")
        except Exception as exc:  # the job fails, the service does not
            if isinstance(exc, BalanceRouteError) and not isinstance(exc, ContractError):
                log.warning("job %s failed: %s", job_id, exc)  # the input's fault
            else:  # a bug of ours: with its traceback
                log.exception("job %s failed", job_id)
            self._set(job_id, status="failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            self.cancelled.discard(job_id)

    def shutdown(self) -> None:
        self._stop.set()
        self.executor.shutdown(wait=False, cancel_futures=True)
