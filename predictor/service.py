"""The service's state and operations, free of HTTP: ingestion, contributions, rebuild.

One :class:`PredictorService` per app. Ingestion is serialized by a lock: the batch is
de-duplicated against the database, inserted and committed, and only then applied to the
learners, so the learners always equal a replay of the committed batches in order (which is
how they are rebuilt after a restart: exactly the same answers).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from . import store
from .calibration import CalibrationTracker, DriftMonitor, Scored, sampled
from .learners import EXACT_MATCH, SURVIVAL, ExactMatchEstimator
from .settings import Settings

CENSORING_REASONS = ("length", "cancelled", "error")


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    duplicates: int
    model_version: int


@dataclass(frozen=True)
class ContributionAnswer:
    c_hat: np.ndarray
    p_fin: np.ndarray
    mu_rem: np.ndarray
    estimator: list[str]
    support: np.ndarray
    model_version: int
    drifted: bool = False


class PredictorService:
    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        self.lock = threading.RLock()
        self.started = time.monotonic()
        self.loaded = False
        self._reset_learners()

    def _reset_learners(self) -> None:
        s = self.settings
        self.learner = ExactMatchEstimator(
            window=s.history, min_support=s.exact_match_min_support,
            max_buckets=s.exact_match_max_buckets, bucket_window=s.exact_match_bucket_window,
        )
        self.model_version = 0
        self.observations = 0
        self.tracker = CalibrationTracker(s.calibration_sample_rate, s.calibration_max_pending,
                                          s.calibration_capacity)
        self.drift = DriftMonitor(s.drift_length_effect, s.drift_loss_effect,
                                  s.drift_clear_after)

    def session(self) -> Session:
        return self.sessions()

    # -- start-up -------------------------------------------------------------------------
    def load(self) -> None:
        """Migrate the schema, rebuild the learners by replaying every stored batch, and the
        calibration buffer and drift streams from the stored scored predictions. Pending
        (not yet scored) predictions live in memory only and do not survive a restart."""
        store.migrate(self.engine)
        with self.lock, self.session() as session:
            self._reset_learners()
            pending: list = []
            for rows in store.observations_in_order(session=session):
                for row in rows:
                    if pending and row[1] != pending[0][1]:
                        self._apply(pending)
                        pending = []
                    pending.append(row)
            if pending:
                self._apply(pending)
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

    def _apply(self, rows: list) -> None:
        durations = np.fromiter((r[2] for r in rows), dtype=np.int64, count=len(rows))
        events = np.fromiter((not r[3] for r in rows), dtype=bool, count=len(rows))
        self.learner.partial_fit(durations, events, [r[4] for r in rows])
        self.observations += len(rows)
        for row in rows:
            self.drift.update_length(int(row[2]), _iso(row[5]))

    def _add_scored(self, scores: list[Scored], when: str | None) -> None:
        """One finished request's scored predictions. The loss stream gets one value per
        request (the mean Brier loss of its ``auto``-rule predictions): predictions of one
        request at successive refreshes share its outcome, and feeding them one by one would
        make the stream look far less noisy than it is."""
        losses = []
        for scored in scores:
            self.tracker.add_scored(scored)
            if scored.estimator == EXACT_MATCH:  # the auto rule: what routers get by default
                losses.append((scored.p_fin - float(scored.ended)) ** 2)
        if losses:
            self.drift.update_loss(float(np.mean(losses)), when)

    # -- operations -----------------------------------------------------------------------
    def ingest(self, observations: list[dict]) -> IngestResult:
        """Store the new observations (all or nothing) and learn from them.

        Each dict has request_id, prompt_key, prompt_tokens, output_tokens, finish_reason and
        completed_at. A request_id already stored, or repeated in the batch, is a duplicate.
        """
        with self.lock:
            with self.session() as session:
                ids = [o["request_id"] for o in observations]
                stored = store.existing_request_ids(session=session, request_ids=ids)
                seen: set[str] = set()
                fresh: list[dict] = []
                for obs in observations:
                    rid = obs["request_id"]
                    if rid in stored or rid in seen:
                        continue
                    seen.add(rid)
                    fresh.append(obs)
                if not fresh:
                    return IngestResult(0, len(observations), self.model_version)
                batch = self.model_version + 1
                now = datetime.now(UTC)
                rows = [
                    {
                        "request_id": o["request_id"],
                        "prompt_key": o.get("prompt_key"),
                        "prompt_tokens": o["prompt_tokens"],
                        "output_tokens": o["output_tokens"],
                        "finish_reason": o["finish_reason"],
                        "censored": o["finish_reason"] in CENSORING_REASONS,
                        "completed_at": o.get("completed_at") or now,
                        "batch": batch,
                    }
                    for o in fresh
                ]
                store.insert_observations(session=session, rows=rows)
                session.commit()  # durable before we answer or learn
            self._apply([(None, batch, r["output_tokens"], r["censored"], r["prompt_key"],
                          r["completed_at"]) for r in rows])
            self.model_version = batch
            self._score(rows)
            return IngestResult(len(fresh), len(observations) - len(fresh), batch)

    def _score(self, rows: list[dict]) -> None:
        """Score the pending predictions of these finished requests and store the scores."""
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
        if stored:
            with self.session() as session:
                store.insert_scored(session=session, rows=stored,
                                    keep=self.settings.calibration_capacity)
                session.commit()

    def contributions(self, generated: np.ndarray, keys: list[str | None], horizon: int,
                      estimator: str = "auto") -> ContributionAnswer:
        """c_hat, p_fin, mu_rem for a batch of active requests (see :meth:`record`)."""
        with self.lock:
            if estimator == SURVIVAL:
                answer = self.learner.fallback_.predict(generated, keys, horizon)
            elif estimator == EXACT_MATCH:
                answer = self.learner.predict(generated, keys, horizon, min_support=1)
            else:
                answer = self.learner.predict(generated, keys, horizon)
            return ContributionAnswer(answer.life.c_hat, answer.life.p_fin, answer.life.mu_rem,
                                      answer.estimator, answer.support, self.model_version,
                                      self.drift.drifted)

    def record(self, request_ids: list[str], generated: np.ndarray, keys: list[str | None],
               horizon: int) -> None:
        """Keep a deterministic sample of a query's items, with every estimator's prediction
        (shadow scoring), for scoring when their outcomes arrive. Runs after the answer has
        been sent."""
        rate = self.settings.calibration_sample_rate
        picks = [i for i, rid in enumerate(request_ids) if sampled(rid, int(generated[i]), rate)]
        if not picks:
            return
        with self.lock:
            if self.observations == 0:
                return  # nothing learned yet: every estimator answers the prior
            sub_generated = generated[picks]
            sub_keys = [keys[i] for i in picks]
            survival = self.learner.fallback_.predict(sub_generated, sub_keys, horizon)
            exact = self.learner.predict(sub_generated, sub_keys, horizon, count=False)
            self.tracker.record_batch(
                [request_ids[i] for i in picks], sub_generated, horizon,
                {SURVIVAL: survival.life.p_fin, EXACT_MATCH: exact.life.p_fin},
                {SURVIVAL: survival.life.c_hat, EXACT_MATCH: exact.life.c_hat},
                np.asarray([e == EXACT_MATCH for e in exact.estimator]),
            )

    def calibration(self, horizon: int | None = None, estimator: str | None = None,
                    window: int | None = None) -> dict:
        with self.lock:
            return {
                "horizon": horizon, "window": window,
                "estimators": self.tracker.report(horizon, estimator, window),
                "pending": self.tracker.pending_count,
                "pending_dropped": self.tracker.dropped,
                "sample_rate": self.settings.calibration_sample_rate,
                "drift": self.drift.state(),
            }

    @property
    def buckets(self) -> int:
        return len(self.learner.buckets_)

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.isoformat()
