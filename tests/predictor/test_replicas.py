"""Replicas on one database: each tails the observations table, so they answer the same
within the poll interval; migrations take turns (advisory lock on PostgreSQL); A/B jobs are
claimed with a lease that another replica's start leaves alone. Bounded; no wall-clock
assertions (the convergence time is printed, the loop gives up after a generous bound)."""

import os
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from sqlalchemy import create_engine, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker

from models import AbJob
from predictor.abjobs import AbJobRunner
from predictor.livesrv import free_port, live_server, stop_process, wait_ready
from predictor.store import make_engine, migrate
from tests.conftest import POSTGRES_URL, require_postgres

POLL = "0.5"  # BALANCEROUTE_REPLICA_POLL_INTERVAL in these tests
QUERY = {"estimator": "exact_match", "horizon": 64, "items": [
    {"request_id": f"q{i}", "prompt_key": f"tpl-{i % 5}", "generated_tokens": i}
    for i in range(40)]}


def _observations(prefix: str, n: int, scale: int) -> list[dict]:
    return [{"request_id": f"{prefix}{i}", "prompt_key": f"tpl-{i % 5}",
             "output_tokens": scale * (1 + i % 7), "finish_reason": "stop"} for i in range(n)]


def _answers(client: httpx.Client) -> tuple[list[float], int]:
    got = client.post("/v1/contributions", json=QUERY).json()
    return [item["c_hat"] for item in got["items"]], got["model_version"]


def _converge(source: httpx.Client, other: httpx.Client) -> float:
    """Seconds until ``other`` answers as ``source`` does (gives up after 60 s)."""
    want = _answers(source)
    started = time.monotonic()
    while _answers(other) != want:
        if time.monotonic() - started > 60:
            pytest.fail("the replicas did not converge within 60 s")
        time.sleep(0.05)
    return time.monotonic() - started


def test_two_replicas_answer_the_same_within_the_poll_interval(database_url):
    env = {"BALANCEROUTE_REPLICA_POLL_INTERVAL": POLL}
    with live_server(database_url, env=env) as a, live_server(database_url, env=env) as b, \
            httpx.Client(base_url=a, timeout=30) as ca, \
            httpx.Client(base_url=b, timeout=30) as cb:
        first = _observations("a", 300, 10)
        assert ca.post("/v1/observations", json={"observations": first}).json() == {
            "accepted": 300, "duplicates": 0}
        seconds = _converge(ca, cb)
        print(f"replica convergence after ingest on A: {seconds:.2f} s (poll {POLL} s)")
        # the same ids sent to the other replica are duplicates, never an error
        again = cb.post("/v1/observations", json={"observations": first[:100]})
        assert again.status_code == 200
        assert again.json() == {"accepted": 0, "duplicates": 100}
        more = _observations("b", 200, 40)
        assert cb.post("/v1/observations", json={"observations": more}).json()[
            "accepted"] == 200
        seconds = _converge(cb, ca)
        print(f"replica convergence after ingest on B: {seconds:.2f} s (poll {POLL} s)")
        assert ca.get("/v1/status").json()["observations"] == 500
        assert cb.get("/v1/status").json()["observations"] == 500
        assert _answers(ca)[1] == _answers(cb)[1] == 2  # model_version is global


def _start(url: str, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "predictor.cli", "serve", "--host", "127.0.0.1", "--port",
         str(port), "--database-url", url],
        env={**os.environ, "BALANCEROUTE_ESTIMATORS": "survival"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _ready(process: subprocess.Popen, port: int) -> None:
    state = wait_ready(process, f"http://127.0.0.1:{port}/readyz", 60, interval_s=0.05)
    if state == "exited":
        error = process.stderr.read().decode() if process.stderr else ""
        pytest.fail(f"a replica exited while starting: {error[-1500:]}")
    if state == "timeout":
        pytest.fail("a replica did not become ready")


@pytest.mark.parametrize("attempt", range(4))
def test_two_replicas_starting_together_on_an_empty_database_both_come_up(attempt):
    name = f"br_race_{uuid.uuid4().hex[:12]}"
    admin = create_engine(require_postgres(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    try:
        with ExitStack() as stack:
            ports = [free_port(), free_port()]
            processes = [_start(url, port) for port in ports]  # at once
            for process in processes:
                stack.callback(_stop, process)
            for process, port in zip(processes, ports, strict=True):
                _ready(process, port)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


_stop = stop_process


def test_another_replicas_start_leaves_a_leased_job_alone(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'lease.db'}")
    migrate(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    first = AbJobRunner(sessions, lease_s=30)
    now = datetime.now(UTC)
    with sessions() as session:
        session.add(AbJob(id="a" * 32, status="running", progress=0.5, request="{}",
                          created_at=now, updated_at=now, owner=first.owner,
                          lease_until=now + timedelta(seconds=30)))
        session.add(AbJob(id="b" * 32, status="queued", progress=0.0, request="{}",
                          created_at=now, updated_at=now, owner="gone",
                          lease_until=now - timedelta(seconds=1)))
        session.commit()
    second = AbJobRunner(sessions, lease_s=30)
    second.recover()  # another replica starts
    try:
        assert second.get("a" * 32)["status"] == "running"
        lost = second.get("b" * 32)
        assert lost["status"] == "failed" and "interrupted" in lost["error"]
        first.renew()  # the owner renews its lease while it lives
        with sessions() as session:
            lease = session.get(AbJob, "a" * 32).lease_until
        assert lease.replace(tzinfo=lease.tzinfo or UTC) > now + timedelta(seconds=25)
        with sessions() as session:  # the owner dies: its lease runs out
            session.execute(update(AbJob).where(AbJob.id == "a" * 32)
                            .values(lease_until=now - timedelta(seconds=1)))
            session.commit()
        assert second.sweep() == 1
        assert second.get("a" * 32)["status"] == "failed"
    finally:
        second.shutdown()
        first.shutdown()
        engine.dispose()
