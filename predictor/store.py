"""Data access: keyword-only functions that take the session explicitly."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from importlib.resources import files
from typing import cast

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, Table, create_engine, delete, event, func, insert, select, text
from sqlalchemy.orm import Session

from models import LearnerSnapshot, Observation, ScoredPrediction

OBSERVATIONS = cast(Table, Observation.__table__)  # the Core table (inserts skip the ORM)
# SQLite allows 32766 bound parameters per statement in current builds, 999 in old ones.
IN_CHUNK = 900
MIGRATION_LOCK = 0x42524D47  # the PostgreSQL advisory lock key of migrations ("BRMG")
SNAPSHOT_LOCK = 0x42525353  # ... of writing a learner snapshot ("BRSS")


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
        # a Core executemany: about a quarter less time per 1,000 rows than the ORM bulk path
        session.execute(insert(OBSERVATIONS), list(rows))


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


def keyed_rows(*, session: Session, after_id: int, upto_id: int, chunk: int = 100_000
               ) -> Iterator[Sequence]:
    """(id, batch, prompt_key, output_tokens, censored) of the observations with an id above
    ``after_id`` and up to ``upto_id``, in id order, ``chunk`` at a time (what a restart
    needs of the observations it does not replay). Plain tuples from the driver's cursor:
    a restart without a snapshot reads every stored row, and SQLAlchemy's row objects would
    take most of its time; ``censored`` is the driver's (0 or 1 on SQLite)."""
    connection = session.connection()
    last_id = after_id
    while True:
        query = (select(Observation.id, Observation.batch, Observation.prompt_key,
                        Observation.output_tokens, Observation.censored)
                 .where(Observation.id > int(last_id), Observation.id <= int(upto_id))
                 .order_by(Observation.id).limit(chunk))
        sql = str(query.compile(dialect=connection.dialect,
                                compile_kwargs={"literal_binds": True}))  # integers only
        cursor = connection.connection.cursor()
        try:
            cursor.execute(sql)
            rows = cursor.fetchall()
        finally:
            cursor.close()
        if not rows:
            return
        last_id = rows[-1][0]
        yield rows


def batch_start(*, session: Session, upto_id: int) -> int:
    """The newest id up to ``upto_id`` that ends a batch: the batch holding ``upto_id + 1``
    starts after it (0: it is the first)."""
    following = session.execute(select(Observation.batch).where(Observation.id > upto_id)
                                .order_by(Observation.id).limit(1)).scalar()
    if following is None:
        return upto_id
    before = session.execute(
        select(Observation.id).where(Observation.id <= upto_id, Observation.batch != following)
        .order_by(Observation.id.desc()).limit(1)).scalar()
    return int(before or 0)


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


# -- learner snapshots (predictor.snapshots) --------------------------------------------------
def try_snapshot_lock(*, session: Session) -> bool:
    """On PostgreSQL, take the snapshot writers' advisory lock for this transaction if no
    other replica holds it (False: one does); elsewhere True (a duplicate write is refused
    by the unique ``upto_id`` and is harmless)."""
    if session.get_bind().dialect.name != "postgresql":
        return True
    return bool(session.execute(text("SELECT pg_try_advisory_xact_lock(:key)"),
                                {"key": SNAPSHOT_LOCK}).scalar())


def snapshot_index(*, session: Session, upto_id: int) -> list[tuple[int, int, int]]:
    """(id, upto_id, format) of the snapshots covering at most ``upto_id``, newest first."""
    return [(int(r[0]), int(r[1]), int(r[2])) for r in session.execute(
        select(LearnerSnapshot.id, LearnerSnapshot.upto_id, LearnerSnapshot.format)
        .where(LearnerSnapshot.upto_id <= upto_id)
        .order_by(LearnerSnapshot.upto_id.desc())).all()]


def snapshot_data(*, session: Session, snapshot_id: int) -> bytes:
    return bytes(session.execute(select(LearnerSnapshot.data)
                                 .where(LearnerSnapshot.id == snapshot_id)).scalar_one())


def newest_snapshot(*, session: Session, fmt: int, params: str) -> int:
    """The newest id a snapshot of this format and these parameters covers (0: none)."""
    return int(session.scalar(
        select(func.coalesce(func.max(LearnerSnapshot.upto_id), 0))
        .where(LearnerSnapshot.format == fmt, LearnerSnapshot.params == params)) or 0)


def insert_snapshot(*, session: Session, upto_id: int, fmt: int, params: str, data: bytes,
                    keep: int) -> None:
    """Store a snapshot and drop all but the newest ``keep`` (by the id they cover)."""
    session.execute(insert(LearnerSnapshot), [{
        "upto_id": upto_id, "format": fmt, "params": params, "data": data,
        "created_at": datetime.now(UTC)}])
    kept = select(LearnerSnapshot.upto_id).order_by(LearnerSnapshot.upto_id.desc()).limit(keep)
    session.execute(delete(LearnerSnapshot).where(LearnerSnapshot.upto_id.not_in(kept)))
