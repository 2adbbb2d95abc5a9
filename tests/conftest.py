from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent
SHARED_TRACES = REPO.parent / "shared" / "traces"

# Developers explore new random examples on every run; CI replays a fixed set (derandomized)
# so that a submission's verdict does not depend on luck.
settings.register_profile(
    "dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", max_examples=100, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "big", max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)


POSTGRES_URL = os.environ.get("BALANCEROUTE_TEST_POSTGRES_URL")


def require_postgres() -> str:
    """The admin URL; skips on a developer machine without it, fails in CI."""
    if not POSTGRES_URL:
        if os.environ.get("CI"):
            pytest.fail("BALANCEROUTE_TEST_POSTGRES_URL is not set in CI")
        pytest.skip("no PostgreSQL (set BALANCEROUTE_TEST_POSTGRES_URL; .ci/run does)")
    return POSTGRES_URL


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path) -> Iterator[str]:
    """A fresh, empty database: SQLite in tmp_path, or a new PostgreSQL database.

    PostgreSQL needs BALANCEROUTE_TEST_POSTGRES_URL (an admin URL; `.ci/run` starts a server
    and sets it). Without it the PostgreSQL case is skipped on a developer machine and fails
    in CI, so CI cannot go green without PostgreSQL.
    """
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'test.db'}"
        return
    require_postgres()
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"br_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def shared_traces() -> Path:
    if not SHARED_TRACES.is_dir():
        pytest.fail(f"../shared/traces is missing (expected beside the repo): {SHARED_TRACES}")
    return SHARED_TRACES
