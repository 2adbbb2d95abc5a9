"""The service's state and operations, free of HTTP: ingestion, contributions, rebuild.

One :class:`PredictorService` per app. Ingestion is serialized by a lock: the batch is
de-duplicated against the database, inserted and committed, and only then applied to the
learners, so the learners always equal a replay of the committed batches in order (which is
how they are rebuilt after a restart: exactly the same answers).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from . import snapshots, store
from .calibration import CalibrationTracker, DriftMonitor, Scored, sampled_rows
from .estimators import Estimate, Estimator, Features, Outcomes, estimator_specs
from .estimators.base import observe_running
from .settings import Settings

CENSORING_REASONS = ("length", "cancelled", "error")
TAIL_CHUNK = 20_000  # observations read per query while tailing
GAP_WAIT = 30.0  # seconds a skipped observation id is looked for again
MAX_GAPS = 100_000
SNAPSHOT_CHECK = 30.0  # seconds between two checks whether a snapshot is due

log = logging.getLogger("balanceroute.service")


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    duplicates: int
    model_version: int


@dataclass(frozen=True)
class ContributionAnswer:
    estimate: Estimate
    model_version: int
    drifted: bool = False


class PredictorService:
    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        self.lock = threading.RLock()  # the learners and trackers (memory only)
        self.ingest_lock = threading.Lock()  # serializes ingestion's database work
        # The drift streams: updated after the learners' lock is released (queries read only
        # the ``drifted`` flag), so a query never waits on the detectors' tests either.
        self.drift_lock = threading.Lock()
        self.fitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-fit")
        self._fit_state = threading.Lock()
        self._fit_queued = False
        self._fit_running = False
        self.started = time.monotonic()
        self.loaded = False
        self.recommendation: dict | None = None  # from the newest done tuning
        self._gaps: dict[int, float] = {}  # observation ids skipped while tailing -> when
        self._stop = threading.Event()
        self._tailer: threading.Thread | None = None
        self._snapshotter: threading.Thread | None = None
        self._reset_learners()

    def _reset_learners(self) -> None:
        s = self.settings
        # One instance of every registered estimator, all fed the same observations.
        wanted = ({n.strip() for n in s.estimators.split(",") if n.strip()}
                  if s.estimators else None)
        self.estimators: dict[str, Estimator] = {
            spec.name: spec.build(s) for spec in estimator_specs()
            if wanted is None or spec.name in wanted}
        if not self.estimators:
            raise ValueError(f"BALANCEROUTE_ESTIMATORS={s.estimators!r} names no registered "
                             "estimator")
        for estimator in self.estimators.values():
            if hasattr(estimator, "fit_deferred"):  # fits outside the lock queries take
                estimator.defer_fits = True  # type: ignore[attr-defined]
            if hasattr(estimator, "fit_in_subprocess"):  # and outside the interpreter
                estimator.fit_in_subprocess = s.hazard_fit_process
        self.auto = s.auto_estimator if s.auto_estimator in self.estimators else next(
            iter(self.estimators))
        self.auto_queries = 0
        self.auto_hits = 0
        self.model_version = 0
        self.observations = 0
        self.last_id = 0  # the newest observation id learned
        self.tracker = CalibrationTracker(
            list(self.estimators), s.calibration_sample_rate, s.calibration_max_pending,
            s.calibration_capacity,
            s.calibration_max_pending_per_caller or max(1, s.calibration_max_pending // 4))
        self.drift = DriftMonitor(s.drift_length_effect, s.drift_loss_effect,
                                  s.drift_clear_after)

    def session(self) -> Session:
        return self.sessions()

    # -- start-up -------------------------------------------------------------------------
    def load(self) -> None:
        """Migrate the schema, rebuild the learners from the stored observations, and the
        calibration buffer and drift streams from the stored scored predictions. Pending
        (not yet scored) predictions live in memory only and do not survive a restart.

        Only what the learners keep is replayed (:meth:`_replay`), so a restart takes seconds
        at a million stored observations."""
        store.migrate(self.engine)
        with self.ingest_lock, self.lock, self.session() as session:
            self._reset_learners()
            self._replay(session)
            group: list[Scored] = []
            group_request: str | None = None
            when: str | None = None
            for rows in store.scored_in_order(session=session):
                for row in rows:  # one request's scores are stored together, in order
                    if group and row[10] != group_request:
                        self._add_scored(group, when)
                        group = []
                    group_request, when = row[10], _iso(row[9])
                    group.append(Scored(row[1], row[2], row[3], row[4], row[5], row[6],
                                        row[7], row[8]))
            if group:
                self._add_scored(group, when)
            self.model_version = store.latest_batch(session=session)
            self.loaded = True

    def _replay(self, session: Session) -> None:
        """The newest ``replay_observations`` observations (from the start of the batch that
        holds the oldest of them) are replayed in full, batch by batch with the fits on the
        same schedule as when they were ingested (with fewer stored, a restart answers exactly
        as before). Older ones only matter to the per-key state, read from the newest
        snapshot and the rows after it (:func:`snapshots.restore`)."""
        for estimator in self.estimators.values():
            if hasattr(estimator, "refresh_deferred"):
                estimator.defer_refresh = True  # type: ignore[attr-defined]
        start = snapshots.snapshot_point(session, self.settings.replay_observations)
        if start:
            began = time.perf_counter()
            state, base = snapshots.restore(session, start, snapshots.KeyParams.of(self.settings))
            for estimator in self.estimators.values():
                if hasattr(estimator, "load_key_state"):
                    estimator.load_key_state(state)
            self.observations = state.observations
            log.info("per-key state of the observations up to %d: snapshot up to %d and %d "
                     "rows after it, %.2f s", start, base, start - base,
                     time.perf_counter() - began)
        self.last_id = start
        pending: list = []
        for rows in store.observations_in_order(session=session, after_id=start):
            for row in rows:
                if pending and row[1] != pending[0][1]:
                    self._learn(pending, replay=True)
                    pending = []
                pending.append(row)
        if pending:
            self._learn(pending, replay=True)
        for estimator in self.estimators.values():
            for finish in ("fit_skipped", "refresh_deferred"):
                if hasattr(estimator, finish):
                    getattr(estimator, finish)()

    def write_snapshot(self) -> int | None:
        """Write a snapshot of the per-key state for later restarts if one is due (see
        :func:`snapshots.write_snapshot`); returns the observation id it covers, or None.
        Reads the database and builds its own arrays: neither the learners nor their lock
        are touched, so queries and ingestion go on meanwhile. Not while an id it would cover
        may still commit late (PostgreSQL, see :meth:`_note_gaps`)."""
        awaited = min(list(self._gaps), default=None)  # a copy: the tailer changes it
        with self.session() as session:
            return snapshots.write_snapshot(session, self.settings, awaited)

    def _apply(self, rows: list) -> None:
        """Learn from rows shaped like :func:`store.observations_in_order`'s."""
        outcomes = _outcomes(rows)
        for estimator in self.estimators.values():
            estimator.partial_fit(outcomes)
        self.observations += len(rows)

    def _add_scored(self, scores: list[Scored], when: str | None) -> None:
        """One finished request's scored predictions. The loss stream gets one value per
        request (the mean Brier loss of its ``auto``-rule predictions): predictions of one
        request at successive refreshes share its outcome, and feeding them one by one would
        make the stream look far less noisy than it is."""
        losses = []
        for scored in scores:
            self.tracker.add_scored(scored)
            if scored.estimator == self.auto:  # the auto rule: what routers get by default
                losses.append((scored.p_fin - float(scored.ended)) ** 2)
        if losses:
            with self.drift_lock:
                self.drift.update_loss(float(np.mean(losses)), when)

    # -- operations -----------------------------------------------------------------------
    def ingest(self, observations: list[dict]) -> IngestResult:
        """Store the new observations (all or nothing) and learn from them.

        Each dict has request_id, prompt_key, prompt_tokens, output_tokens, finish_reason and
        completed_at. A request_id already stored (by this replica or another one on the same
        database), or repeated in the batch, is a duplicate. Database work runs under
        ``ingest_lock`` only; the learners' ``lock``, which queries take, is held just for the
        in-memory update, so a query never waits on a commit.
        """
        with self.ingest_lock:
            rows, batch = self._store(observations)
            if not rows:
                return IngestResult(0, len(observations), self.model_version)
            self._catch_up()  # ours and whatever other replicas committed before, in id order
            with self.lock:
                scored = self._score(rows)
            if scored:
                with self.session() as session:
                    store.insert_scored(session=session, rows=scored,
                                        keep=self.settings.calibration_capacity)
                    session.commit()
            return IngestResult(len(rows), len(observations) - len(rows), batch)

    # -- replicas -------------------------------------------------------------------------
    def catch_up(self) -> int:
        """Learn what was committed since we last looked (by any replica on the database),
        in id order; returns how many observations were learned. Run every
        ``replica_poll_interval`` seconds by :meth:`start_tailing`, and after each ingest."""
        with self.ingest_lock:
            return self._catch_up()

    def _catch_up(self) -> int:
        learned = 0
        with self.session() as session:
            if self._gaps:
                learned += self._fill_gaps(session)
            while True:
                rows = store.observations_after(session=session, after_id=self.last_id,
                                                limit=TAIL_CHUNK)
                if not rows:
                    break
                self._note_gaps(rows)
                self._learn(rows)
                learned += len(rows)
                if len(rows) < TAIL_CHUNK:
                    break
        if learned:
            self._schedule_fits()
        return learned

    def _note_gaps(self, rows) -> None:
        """Ids skipped below the newest one seen: on PostgreSQL a transaction that took a
        smaller id may commit after a larger one; such ids are looked up again for
        ``GAP_WAIT`` seconds (an id whose insert was rolled back never appears)."""
        expected, now = self.last_id + 1, time.monotonic()
        for row in rows:
            if row[0] > expected and self.loaded:
                for missing in range(expected, min(row[0], expected + MAX_GAPS)):
                    if len(self._gaps) < MAX_GAPS:
                        self._gaps[missing] = now
            expected = row[0] + 1

    def _fill_gaps(self, session: Session) -> int:
        now = time.monotonic()
        for missing in [i for i, seen in self._gaps.items() if now - seen > GAP_WAIT]:
            del self._gaps[missing]
        late = store.observations_with_ids(session=session, ids=list(self._gaps))
        for row in late:
            del self._gaps[row[0]]
        if late:
            self._learn(late, advance=False)
        return len(late)

    def _learn(self, rows, advance: bool = True, replay: bool = False) -> None:
        """Apply stored rows (``store.observations_in_order``'s shape), batch by batch; a
        ``replay`` keeps the fit schedule but fits only the newest due fit (at the end)."""
        with self.lock:
            pending: list = []
            for row in rows:
                if pending and row[1] != pending[0][1]:
                    self._apply(pending)
                    if replay:
                        self._skip_due_fits()
                    pending = []
                pending.append(row)
            if pending:
                self._apply(pending)
                if replay:
                    self._skip_due_fits()
            if advance:
                self.last_id = max(self.last_id, int(rows[-1][0]))
            self.model_version = max(self.model_version, max(int(r[1]) for r in rows))
        with self.drift_lock:  # in the same (id) order, outside the learners' lock
            for row in rows:
                self.drift.update_length(int(row[2]), _iso(row[5]))

    def start_tailing(self) -> None:
        """Poll the observations table every ``replica_poll_interval`` seconds (0: never), and
        check every ``SNAPSHOT_CHECK`` seconds whether a snapshot is due (``snapshot_every``,
        0: never), each on a daemon thread: a replica learns what the others ingested within
        about that long."""
        interval = self.settings.replica_poll_interval
        if interval > 0 and self._tailer is None:
            self._tailer = self._every(interval, self.catch_up, "replica-tail",
                                       "tailing the observations table failed")
        if self.settings.snapshot_every > 0 and self._snapshotter is None:
            self._snapshotter = self._every(SNAPSHOT_CHECK, self.write_snapshot,
                                            "learner-snapshot", "writing a snapshot failed")

    def _every(self, interval: float, work, name: str, failed: str) -> threading.Thread:
        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    work()
                except Exception:  # the database is away: try again at the next tick
                    log.warning(failed, exc_info=True)

        thread = threading.Thread(target=loop, name=name, daemon=True)
        thread.start()
        return thread

    def stop_tailing(self) -> None:
        self._stop.set()
        for thread in (self._tailer, self._snapshotter):
            if thread is not None:
                thread.join(timeout=5)

    def _schedule_fits(self) -> None:
        """Run due model fits on the fitter thread: neither ingestion nor queries wait for
        them. Fits due while one runs are coalesced into the next (on the newest window)."""
        with self._fit_state:
            if self._fit_queued:
                return
            self._fit_queued = True
        self.fitter.submit(self._run_fits)

    def _run_fits(self) -> None:
        with self._fit_state:
            self._fit_queued, self._fit_running = False, True
        try:
            self._fit_deferred()
        except Exception:  # a failed fit keeps the previous model; the service goes on
            log.exception("a deferred model fit failed")
        finally:
            with self._fit_state:
                self._fit_running = False

    @property
    def fitting(self) -> bool:
        """A model fit is queued or running (on the fitter thread, sharing the interpreter
        with queries: their latency is higher meanwhile)."""
        with self._fit_state:
            return self._fit_queued or self._fit_running

    def wait_for_fits(self) -> None:
        """Block until the fits scheduled so far are done (tests, benchmarks)."""
        self.fitter.submit(lambda: None).result()

    def _fit_deferred(self) -> None:
        """Model fits an estimator deferred (see ``HazardEstimator.fit_deferred``), run
        outside the lock that queries take."""
        for name, estimator in self.estimators.items():
            fit = getattr(estimator, "fit_deferred", None)
            if fit is not None:
                try:  # one estimator's failure must not hold back the others' work
                    fit(self.lock)
                except Exception:  # it keeps its previous model; the service goes on
                    log.exception("a deferred fit of %s failed", name)

    def _skip_due_fits(self) -> None:
        for estimator in self.estimators.values():
            skip = getattr(estimator, "skip_due_fit", None)
            if skip is not None:
                skip()

    def _store(self, observations: list[dict], attempts: int = 3) -> tuple[list[dict], int]:
        """Insert and commit the observations not stored yet; returns them and their batch.

        Another replica may commit some of the same ids between our check and our insert:
        the unique key then refuses the batch, and we check again (those are duplicates)."""
        for attempt in range(attempts):
            with self.session() as session:
                ids = [o["request_id"] for o in observations]
                stored = store.existing_request_ids(session=session, request_ids=ids)
                fresh = []
                for obs in observations:  # the first of repeated ids, in batch order
                    if obs["request_id"] not in stored:
                        stored.add(obs["request_id"])
                        fresh.append(obs)
                if not fresh:
                    return [], self.model_version
                batch = store.latest_batch(session=session) + 1  # global across replicas
                now = datetime.now(UTC)
                rows = [{"request_id": o["request_id"], "prompt_key": o.get("prompt_key"),
                         "prompt_tokens": o["prompt_tokens"], "output_tokens": o["output_tokens"],
                         "finish_reason": o["finish_reason"],
                         "censored": o["finish_reason"] in CENSORING_REASONS,
                         "completed_at": o.get("completed_at") or now, "batch": batch}
                        for o in fresh]
                try:
                    store.insert_observations(session=session, rows=rows)
                    session.commit()  # durable before we answer or learn
                except IntegrityError:
                    session.rollback()
                    if attempt == attempts - 1:
                        raise
                    continue
                return rows, batch
        raise RuntimeError("unreachable")  # pragma: no cover

    def _score(self, rows: list[dict]) -> list[dict]:
        """Score the pending predictions of these finished requests (in memory); returns the
        rows to store."""
        stored: list[dict] = []
        for row in rows:
            when = row["completed_at"]
            scores = self.tracker.resolve(row["request_id"], row["output_tokens"],
                                          row["censored"])
            if scores:
                self._add_scored(scores, _iso(when))
            for scored in scores:
                stored.append({
                    "request_id": row["request_id"], "estimator": scored.estimator,
                    "horizon": scored.horizon, "generated_tokens": scored.generated,
                    "p_fin": scored.p_fin, "c_hat": scored.c_hat, "ended": scored.ended,
                    "realized": scored.realized, "hit": scored.hit, "scored_at": when,
                })
        return stored

    def contributions(self, features: Features, horizon: int,
                      estimator: str = "auto") -> ContributionAnswer:
        """c_hat, p_fin, mu_rem for a batch of active requests (see :meth:`record`).

        ``estimator`` is a registered name or ``auto`` (``BALANCEROUTE_AUTO_ESTIMATOR``)."""
        name = self.auto if estimator == "auto" else estimator
        with self.lock:
            observe_running(self.estimators.values(), features)  # queried: running now
            estimate = self.estimators[name].predict(features, horizon)
            if estimator == "auto":
                self.auto_queries += len(features)
                self.auto_hits += estimate.source.count(name)
            return ContributionAnswer(estimate, self.model_version, self.drift.drifted)

    def record(self, request_ids: list[str], features: Features, horizon: int,
               caller: str = "") -> None:
        """Keep a deterministic sample of a query's items, with every estimator's prediction
        (shadow scoring), for scoring when their outcomes arrive; ``caller`` (the client's
        address) gets a fair share of the pending slots. Runs after the answer has been
        sent."""
        generated = features.generated.tolist()
        picks = sampled_rows(request_ids, generated, self.settings.calibration_sample_rate)
        if not picks:
            return
        with self.lock:
            if self.observations == 0:
                return  # nothing learned yet: every estimator answers the prior
            picks = self.tracker.unrecorded(request_ids, generated, horizon, picks)
            if not picks:
                return
            sub = features.take(picks)
            answers = {name: est.predict(sub, horizon) for name, est in self.estimators.items()}
            self.tracker.record_batch(
                [request_ids[i] for i in picks], sub.generated, horizon,
                {name: a.p_fin for name, a in answers.items()},
                {name: a.c_hat for name, a in answers.items()},
                {name: np.asarray([s == name for s in a.source]) for name, a in answers.items()},
                caller,
            )

    @property
    def hit_rate(self) -> float:
        """Share of ``auto`` items answered by the auto estimator itself (not a fallback)."""
        return self.auto_hits / self.auto_queries if self.auto_queries else 0.0

    def calibration(self, horizon: int | None = None, estimator: str | None = None,
                    window: int | None = None) -> dict:
        with self.lock:
            return {
                "horizon": horizon, "window": window,
                "estimators": self.tracker.report(horizon, estimator, window),
                "pending": self.tracker.pending_count,
                "pending_dropped": self.tracker.dropped,
                "sample_rate": self.settings.calibration_sample_rate,
                "drift": self._drift_state(),
            }

    def _drift_state(self) -> dict:
        with self.drift_lock:
            return self.drift.state()

    @property
    def buckets(self) -> int:
        """Per-key groups held by the estimators (ExactMatch's buckets)."""
        return sum(int(getattr(est, "n_groups_", 0)) for est in self.estimators.values())

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started


def _outcomes(rows) -> Outcomes:
    """Rows shaped like :func:`store.observations_in_order`'s as :class:`Outcomes`."""
    return Outcomes.of(
        np.fromiter((r[2] for r in rows), dtype=np.int64, count=len(rows)),
        np.fromiter((r[3] for r in rows), dtype=bool, count=len(rows)),
        [r[4] for r in rows], [r[6] for r in rows])


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.isoformat()
