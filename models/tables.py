"""Tables. Only portable SQL types: the same schema runs on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite only autoincrements INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
BigIntId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


class Observation(Base):
    """A finished request, as reported to ``POST /v1/observations``.

    ``request_id`` is the idempotency key. ``prompt_key`` is the caller's key or the xxh3_64
    hex of the prompt text (the text itself is never stored). ``batch`` is the model version
    the observation's batch produced: replaying batches in order rebuilds the learners exactly.
    """

    __tablename__ = "observations"

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128), unique=True, nullable=False)
    prompt_key: Mapped[str | None] = mapped_column(String(256), nullable=True)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)  # None: unknown
    output_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    finish_reason: Mapped[str] = mapped_column(String(16), nullable=False)
    censored: Mapped[bool] = mapped_column(Boolean, nullable=False)
    completed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    batch: Mapped[int] = mapped_column(BigInteger, nullable=False)

    __table_args__ = (Index("ix_observations_batch", "batch"),)


class ScoredPrediction(Base):
    """A prediction the service issued (or shadow-computed), scored against its outcome.

    Kept for the calibration report and the loss-drift stream across restarts; the newest
    ``BALANCEROUTE_CALIBRATION_CAPACITY`` rows are retained.
    """

    __tablename__ = "scored_predictions"

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128), nullable=False)
    estimator: Mapped[str] = mapped_column(String(32), nullable=False)
    horizon: Mapped[int] = mapped_column(Integer, nullable=False)
    generated_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    p_fin: Mapped[float] = mapped_column(Float, nullable=False)
    c_hat: Mapped[float] = mapped_column(Float, nullable=False)
    ended: Mapped[bool] = mapped_column(Boolean, nullable=False)
    realized: Mapped[float] = mapped_column(Float, nullable=False)
    hit: Mapped[bool] = mapped_column(Boolean, nullable=False)
    scored_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class AbJob(Base):
    """A background job started over REST: a simulated A/B comparison (``kind = "ab"``,
    ``POST /v1/ab-comparisons``) or a tuning (``kind = "tuning"``, ``POST /v1/tunings``).

    ``request`` holds the validated request (JSON) without a trace's content; ``results`` the
    CLI-shaped rows (JSON; for a tuning, the ranked rows and the recommendation). ``owner``
    and ``lease_until``: the replica that claimed an active job, renewed while it lives.
    """

    __tablename__ = "ab_jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), nullable=False, default="ab",
                                      server_default="ab")
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    progress: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    request: Mapped[str] = mapped_column(Text, nullable=False)
    results: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    # The replica running (or holding in its queue) an active job, and until when its claim
    # holds without renewal; an active job whose lease ran out lost its replica.
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (Index("ix_ab_jobs_kind_status", "kind", "status"),)


class LearnerSnapshot(Base):
    """The learners' per-key state as of an observation id (``upto_id``: every observation up
    to it is in it), so a restart reads it and the observations after it instead of every
    stored row (:mod:`predictor.snapshots`). ``format`` and ``params`` (JSON) say how it was
    made; one of another format or parameters is not used. The newest few are kept."""

    __tablename__ = "learner_snapshots"

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    upto_id: Mapped[int] = mapped_column(BigInteger, unique=True, nullable=False)
    format: Mapped[int] = mapped_column(Integer, nullable=False)
    params: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    data: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
