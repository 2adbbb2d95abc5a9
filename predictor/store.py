"""Data access: keyword-only functions that take the session explicitly."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from importlib.resources import files

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, case, create_engine, delete, event, func, insert, select, text
from sqlalchemy.orm import Session

from models import Observation, ScoredPrediction

# SQLite allows 32766 bound parameters per statement in current builds, 999 in old ones.
IN_CHUNK = 900
MIGRATION_LOCK = 0x42524D47  # the PostgreSQL advisory lock key of migrations ("BRMG")


def make_engine(url: str) -> Engine:
    """An engine; SQLite gets WAL (durable commits that do not block readers)."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection, _record) -> None:  # pragma: no cover - driver hook
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")
            try:
                cursor.execute("SELECT ln(1.0)")
            except Exception:  # SQLite built without its math functions
                dbapi_connection.create_function("ln", 1, math.log, deterministic=True)
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest Alembic revision (from an empty database too); on
    PostgreSQL under an advisory lock, so replicas starting at once do not race."""
    config = Config()
    # The migrations are package data (importlib.resources), so a regular, non-editable
    # ``pip install`` can migrate too.
    config.set_main_option("script_location", str(files("migrations")))
    config.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False))
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            # Replicas starting together on one database take turns (the lock is released
            # with this transaction); the later ones find the schema at head.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                               {"key": MIGRATION_LOCK})
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def ping(*, session: Session) -> bool:
    return session.execute(text("SELECT 1")).scalar() == 1


def existing_request_ids(*, session: Session, request_ids: Sequence[str]) -> set[str]:
    found: set[str] = set()
    for start in range(0, len(request_ids), IN_CHUNK):
        chunk = request_ids[start : start + IN_CHUNK]
        found.update(
            session.scalars(select(Observation.request_id).where(Observation.request_id.in_(chunk)))
        )
    return found


def insert_observations(*, session: Session, rows: Sequence[dict]) -> None:
    if rows:
        session.execute(insert(Observation), list(rows))


def latest_batch(*, session: Session) -> int:
    return int(session.scalar(select(func.coalesce(func.max(Observation.batch), 0))) or 0)


def _in_id_order(session: Session, columns: Sequence, chunk: int,
                 after_id: int = 0) -> Iterator[Sequence]:
    """Rows of ``columns`` (the first is the table's id) in id order, ``chunk`` at a time
    (keyset pagination: constant memory whatever the table size)."""
    id_column = columns[0]
    last_id = after_id
    while True:
        rows = session.connection().execute(
            select(*columns).where(id_column > last_id).order_by(id_column).limit(chunk)
        ).all()
        if not rows:
            return
        last_id = rows[-1][0]
        yield rows


_OBSERVATION_COLUMNS = (Observation.id, Observation.batch, Observation.output_tokens,
                        Observation.censored, Observation.prompt_key, Observation.completed_at,
                        Observation.prompt_tokens)


def observations_in_order(*, session: Session, chunk: int = 20000,
                          after_id: int = 0) -> Iterator[Sequence]:
    """The observations with an id above ``after_id`` as (id, batch, output_tokens, censored,
    prompt_key, completed_at, prompt_tokens), in ingestion order."""
    return _in_id_order(session, _OBSERVATION_COLUMNS, chunk, after_id)


def keyed_outcomes(*, session: Session, upto_id: int, chunk: int = 100_000
                   ) -> Iterator[Sequence]:
    """(id, prompt_key, output_tokens, censored) of the observations with a prompt key and an
    id up to ``upto_id``, in id order, ``chunk`` at a time (what a restart needs of the
    observations it does not replay)."""
    last_id = 0
    while True:
        rows = session.connection().execute(
            select(Observation.id, Observation.prompt_key, Observation.output_tokens,
                   Observation.censored)
            .where(Observation.id > last_id, Observation.id <= upto_id,
                   Observation.prompt_key.is_not(None))
            .order_by(Observation.id).limit(chunk)).all()
        if not rows:
            return
        last_id = rows[-1][0]
        yield rows


def ended_log_total(*, session: Session, upto_id: int) -> tuple[int, float]:
    """Over the observations with an id up to ``upto_id`` (with or without a key): how many
    ended, and the sum of ``ln(1 + output)`` over those."""
    ended = ~Observation.censored
    total = session.connection().execute(
        select(func.sum(case((ended, 1), else_=0)),
               func.sum(case((ended, func.ln(Observation.output_tokens + 1.0)), else_=0.0)))
        .where(Observation.id <= upto_id)).one()
    return int(total[0] or 0), float(total[1] or 0.0)


def count_observations(*, session: Session, upto_id: int) -> int:
    return int(session.scalar(select(func.count()).select_from(Observation)
                              .where(Observation.id <= upto_id)) or 0)


def observations_after(*, session: Session, after_id: int, limit: int = 20000) -> Sequence:
    """Up to ``limit`` observations with an id above ``after_id``, in id order, shaped like
    :func:`observations_in_order`'s rows (how a replica tails what others ingested)."""
    return session.execute(
        select(*_OBSERVATION_COLUMNS).where(Observation.id > after_id)
        .order_by(Observation.id).limit(limit)).all()


def observations_with_ids(*, session: Session, ids: Sequence[int]) -> list:
    """The observations among ``ids`` that exist now (late commits filling a gap)."""
    found: list = []
    for start in range(0, len(ids), IN_CHUNK):
        chunk = ids[start : start + IN_CHUNK]
        found.extend(session.execute(
            select(*_OBSERVATION_COLUMNS).where(Observation.id.in_(chunk))).all())
    return sorted(found, key=lambda row: row[0])


def latest_observation_id(*, session: Session) -> int:
    return int(session.scalar(select(func.coalesce(func.max(Observation.id), 0))) or 0)


def insert_scored(*, session: Session, rows: Sequence[dict], keep: int) -> None:
    """Store scored predictions and drop all but the newest ``keep``."""
    if not rows:
        return
    session.execute(insert(ScoredPrediction), list(rows))
    newest = session.scalar(select(func.max(ScoredPrediction.id))) or 0
    session.execute(delete(ScoredPrediction).where(ScoredPrediction.id <= newest - keep))


def scored_in_order(*, session: Session, chunk: int = 20000) -> Iterator[Sequence]:
    """Stored scored predictions, oldest first: (id, estimator, horizon, generated_tokens,
    p_fin, c_hat, ended, realized, hit, scored_at, request_id)."""
    return _in_id_order(session, (ScoredPrediction.id, ScoredPrediction.estimator,
                                  ScoredPrediction.horizon, ScoredPrediction.generated_tokens,
                                  ScoredPrediction.p_fin, ScoredPrediction.c_hat,
                                  ScoredPrediction.ended, ScoredPrediction.realized,
                                  ScoredPrediction.hit, ScoredPrediction.scored_at,
                                  ScoredPrediction.request_id), chunk)
