"""Data access: keyword-only functions that take the session explicitly."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from importlib.resources import files

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, delete, event, func, insert, select, text
from sqlalchemy.orm import Session

from models import Observation, ScoredPrediction

# SQLite allows 32766 bound parameters per statement in current builds, 999 in old ones.
IN_CHUNK = 900


def make_engine(url: str) -> Engine:
    """An engine; SQLite gets WAL (durable commits that do not block readers)."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection, _record) -> None:  # pragma: no cover - driver hook
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest Alembic revision (from an empty database too)."""
    config = Config()
    # The migrations are package data (importlib.resources), so a regular, non-editable
    # ``pip install`` can migrate too.
    config.set_main_option("script_location", str(files("migrations")))
    config.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False))
    with engine.begin() as connection:
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


def _in_id_order(session: Session, columns: Sequence, chunk: int) -> Iterator[Sequence]:
    """Rows of ``columns`` (the first is the table's id) in id order, ``chunk`` at a time
    (keyset pagination: constant memory whatever the table size)."""
    id_column = columns[0]
    last_id = 0
    while True:
        rows = session.execute(
            select(*columns).where(id_column > last_id).order_by(id_column).limit(chunk)
        ).all()
        if not rows:
            return
        last_id = rows[-1][0]
        yield rows


def observations_in_order(*, session: Session, chunk: int = 20000) -> Iterator[Sequence]:
    """All observations as (id, batch, output_tokens, censored, prompt_key, completed_at,
    prompt_tokens), in ingestion order."""
    return _in_id_order(session, (Observation.id, Observation.batch, Observation.output_tokens,
                                  Observation.censored, Observation.prompt_key,
                                  Observation.completed_at, Observation.prompt_tokens), chunk)


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
