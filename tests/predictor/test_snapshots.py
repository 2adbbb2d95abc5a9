"""The per-key state a restart reads instead of every stored row (predictor.snapshots): equal
to what the live learners keep, however it is reached (one scan, a snapshot and the rows
after it, a snapshot read back from its bytes)."""

import numpy as np
import pytest

from predictor.estimators import ExactMatchEstimator, HazardEstimator, Outcomes
from predictor.settings import Settings
from predictor.snapshots import (
    KeyParams,
    KeyState,
    SnapshotError,
    advance,
    code_rows,
    decode,
    encode,
)


def _batches(seed: int, n_batches: int, n_keys: int) -> list[list[tuple]]:
    """Batches of (id, batch, key, output, censored): some rows without a key, some cut."""
    rng = np.random.default_rng(seed)
    batches, next_id = [], 1
    for batch in range(1, n_batches + 1):
        rows = []
        for _ in range(int(rng.integers(1, 60))):
            key = None if rng.random() < 0.1 else f"k{int(rng.integers(0, n_keys))}"
            rows.append((next_id, batch, key, int(rng.lognormal(4, 1.5)) + 1,
                         bool(rng.random() < 0.25)))
            next_id += 1
        batches.append(rows)
    return batches


def _live(batches, params: KeyParams):
    exact = ExactMatchEstimator(bucket_window=params.bucket_window,
                                max_buckets=params.max_buckets, max_bytes=params.max_bytes,
                                estimate_weight=params.estimate_weight)
    hazard = HazardEstimator(max_keys=params.max_keys)
    hazard.defer_fits = True  # the per-key statistics only
    for rows in batches:
        outcomes = Outcomes.of([r[3] for r in rows], [r[4] for r in rows], [r[2] for r in rows])
        exact.partial_fit(outcomes)
        hazard.partial_fit(outcomes)
    return exact, hazard


def _loaded(state: KeyState, params: KeyParams):
    exact = ExactMatchEstimator(bucket_window=params.bucket_window,
                                max_buckets=params.max_buckets, max_bytes=params.max_bytes,
                                estimate_weight=params.estimate_weight)
    hazard = HazardEstimator(max_keys=params.max_keys)
    return exact.load_key_state(state), hazard.load_key_state(state)


def assert_same_keys(got, want) -> None:
    (exact, hazard), (live_exact, live_hazard) = got, want
    assert list(exact.buckets_) == list(live_exact.buckets_)  # the same order, too
    for key, bucket in live_exact.buckets_.items():
        mine = exact.buckets_[key]
        for name in ("durations", "events", "bins"):
            np.testing.assert_array_equal(getattr(mine, name), getattr(bucket, name))
            assert getattr(mine, name).dtype == getattr(bucket, name).dtype
    assert exact.bytes_ == live_exact.bytes_
    assert exact._since_refresh == live_exact._since_refresh
    assert exact.prior_weight_ == live_exact.prior_weight_
    assert list(hazard.keys_.table.items()) == list(live_hazard.keys_.table.items())  # bitwise
    assert (hazard.keys_.ended, hazard.keys_.total) == (live_hazard.keys_.ended,
                                                         live_hazard.keys_.total)


@pytest.mark.parametrize("seed, window, estimate", [(0, 8, True), (1, 256, True),
                                                    (2, 3, False)])
def test_one_scan_a_snapshot_and_its_bytes_give_what_the_learners_keep(seed, window, estimate):
    params = KeyParams.of(Settings(exact_match_bucket_window=window,
                                   exact_match_estimate_weight=estimate))
    batches = _batches(seed, 80, 40)
    live = _live(batches, params)
    assert live[0].prior_weight_ != 1.0 or not estimate  # k was estimated on the way
    scanned = advance(KeyState(), code_rows(batches, KeyState()), params)
    assert scanned.upto_id == batches[-1][-1][0]
    assert scanned.observations == sum(len(rows) for rows in batches)
    assert_same_keys(_loaded(scanned, params), live)
    for cut in (1, 17, 53, 79):  # a snapshot after batch `cut`, then the rows after it
        older = advance(KeyState(), code_rows(batches[:cut], KeyState()), params)
        older = decode(encode(older, params), params)
        state = advance(older, code_rows(batches[cut:], older), params)
        assert_same_keys(_loaded(state, params), live)
        assert decode(encode(state, params), params).keys == state.keys


def test_keys_past_the_bounds_keep_the_most_recently_updated_that_fit():
    params = KeyParams.of(Settings(exact_match_max_buckets=30, exact_match_max_bytes=1 << 16))
    batches = _batches(4, 200, 400)
    state = advance(KeyState(), code_rows(batches, KeyState()), params)
    exact, hazard = _loaded(state, params)
    live_exact, _ = _live(batches, params)
    assert exact.n_groups_ == 30 and len(hazard.keys_.table) == 30
    assert exact.bytes_ <= params.max_bytes
    assert list(exact.buckets_) == list(live_exact.buckets_)  # the same keys, in order
    assert len(state.keys) == 30  # nothing else is carried


def test_a_snapshot_of_another_format_or_parameters_or_damaged_is_refused():
    params = KeyParams.of(Settings())
    batches = _batches(5, 10, 5)
    data = encode(advance(KeyState(), code_rows(batches, KeyState()), params), params)
    with pytest.raises(SnapshotError, match="made under"):
        decode(data, KeyParams.of(Settings(exact_match_bucket_window=7)))
    with pytest.raises(SnapshotError, match="unreadable"):
        decode(data[: len(data) // 2], params)
    with pytest.raises(SnapshotError, match="unreadable"):
        decode(b"not a snapshot", params)


# -- the service: restarts from a snapshot, writers, replicas --------------------------------
def _service(url, **overrides):
    from predictor.service import PredictorService
    from predictor.store import make_engine

    settings = Settings(database_url=url, history=300, replay_observations=400,
                        exact_match_bucket_window=8, snapshot_every=500,
                        hazard_refit_every=100_000, **overrides)
    service = PredictorService(settings, make_engine(url))
    service.load()
    return service


def _ingest(service, batches: range, seed: int = 3) -> None:
    rng = np.random.default_rng(seed + batches.start)
    for batch in batches:  # keys k0..k19 in the first half, k20..k39 after
        keys = range(0, 20) if batch < 10 else range(20, 40)
        service.ingest([{"request_id": f"r{batch}-{i}", "prompt_key": f"k{rng.choice(keys)}",
                         "prompt_tokens": 100, "output_tokens": int(rng.integers(1, 150)),
                         "finish_reason": "length" if rng.random() < 0.2 else "stop"}
                        for i in range(100)])


def _answers(service) -> dict:
    from predictor.estimators import Features

    service.wait_for_fits()  # k's estimates run off the lock, as the hazard model's fits do
    rng = np.random.default_rng(7)
    features = Features.of(rng.integers(0, 120, 80), [f"k{i % 40}" for i in range(80)],
                           [100] * 80)
    # the hazard model's fits after a restart are the replay's schedule, not the live one
    # (not compared); its per-key sums are
    got = {name: service.contributions(features, 40, name).estimate
           for name in ("exact_match", "survival")}
    exact = service.estimators["exact_match"]
    keyed = service.estimators["hazard"].keyed_  # the hazard model's key curves
    return {"answers": {name: (e.c_hat.tolist(), e.p_fin.tolist(), e.source)
                        for name, e in got.items()},
            "k": exact.prior_weight_,
            "buckets": [(k, b.durations.tolist(), b.bins.tolist())
                        for k, b in exact.buckets_.items()],
            "hazard key curves": (keyed.prior_weight_,
                                  [(k, b.durations.tolist(), b.events.tolist())
                                   for k, b in keyed.buckets_.items()]),
            "sums": list(service.estimators["hazard"].keys_.table.items()),
            "counts": (service.observations, service.model_version, service.last_id)}


def _answers_after_restart(url) -> dict:
    service = _service(url)
    try:
        return _answers(service)
    finally:
        service.engine.dispose()


def _snapshot_rows(url):
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.connect() as connection:
        rows = connection.execute(text(
            "SELECT upto_id, format FROM learner_snapshots ORDER BY upto_id")).all()
    engine.dispose()
    return [tuple(r) for r in rows]


def _alter_snapshots(url, statement: str, **params) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text(statement), params)
    engine.dispose()


def test_restart_from_a_snapshot_answers_as_before(database_url, caplog):
    """A snapshot older than some rows, none, a damaged one, one of another format: the
    restart answers as the service did before it (k estimated, not fixed)."""
    service = _service(database_url)
    _ingest(service, range(12))
    service._gaps[700] = 0.0  # an id it would cover may still commit (PostgreSQL): wait
    assert service.write_snapshot() is None
    del service._gaps[700]
    assert service.write_snapshot() == 800  # the replay of the newest 400 starts after 800
    assert service.write_snapshot() is None  # not due again
    _ingest(service, range(12, 20))
    before = _answers(service)
    assert before["k"] != 1.0 and len(before["buckets"]) == 40
    service.engine.dispose()
    assert _snapshot_rows(database_url) == [(800, 1)]

    restarted = _service(database_url)  # the snapshot, 800 rows after it, 400 replayed
    assert _answers(restarted) == before
    assert restarted.write_snapshot() == 1600  # 800 more than the newest: due
    restarted.engine.dispose()
    assert _answers_after_restart(database_url) == before  # the snapshot at 1600

    caplog.set_level("WARNING", logger="balanceroute.snapshots")
    _alter_snapshots(database_url, "UPDATE learner_snapshots SET data = :junk "
                     "WHERE upto_id = 1600", junk=b"\x00" * 100)
    assert _answers_after_restart(database_url) == before  # from the one at 800
    assert "learner snapshot" in caplog.text and "unreadable" in caplog.text
    caplog.clear()
    _alter_snapshots(database_url, "UPDATE learner_snapshots SET format = 99")
    assert _answers_after_restart(database_url) == before  # every row scanned
    assert "has format 99" in caplog.text
    _alter_snapshots(database_url, "DELETE FROM learner_snapshots")
    assert _answers_after_restart(database_url) == before


def test_a_newer_format_is_passed_over_with_a_warning(tmp_path, caplog, monkeypatch):
    from predictor import snapshots

    url = f"sqlite:///{tmp_path / 'fmt.db'}"
    service = _service(url)
    _ingest(service, range(14))
    assert service.write_snapshot() == 1000
    before = _answers(service)
    service.engine.dispose()
    monkeypatch.setattr(snapshots, "SNAPSHOT_FORMAT", 2)  # a later version reads it
    caplog.set_level("WARNING", logger="balanceroute.snapshots")
    assert _answers_after_restart(url) == before
    assert "has format 1, this version reads 2" in caplog.text


def test_replicas_write_one_snapshot_and_a_duplicate_is_harmless(database_url, monkeypatch):
    from predictor import snapshots, store

    first, second = _service(database_url), _service(database_url)
    _ingest(first, range(12))
    second.catch_up()
    assert first.write_snapshot() == 800
    assert second.write_snapshot() is None  # the other replica's is as new
    # two replicas that both found none due write the same one: the second is refused
    monkeypatch.setattr(store, "newest_snapshot", lambda **_: 0)
    assert second.write_snapshot() is None
    assert _snapshot_rows(database_url) == [(800, snapshots.SNAPSHOT_FORMAT)]
    before = _answers(first)
    for service in (first, second):
        service.engine.dispose()
    assert _answers_after_restart(database_url) == before


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)  # its advisory lock
def test_only_one_replica_writes_at_a_time_on_postgresql(database_url):
    from sqlalchemy import create_engine, text

    from predictor.store import SNAPSHOT_LOCK

    service = _service(database_url)
    _ingest(service, range(12))
    other = create_engine(database_url)
    with other.begin() as connection:  # another replica is writing one
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SNAPSHOT_LOCK})
        assert service.write_snapshot() is None
    other.dispose()
    assert service.write_snapshot() == 800
    service.engine.dispose()


def test_writing_a_snapshot_holds_no_lock_queries_or_ingestion_take(tmp_path, monkeypatch):
    import threading

    from predictor import snapshots
    from predictor.estimators import Features

    service = _service(f"sqlite:///{tmp_path / 'lock.db'}")
    _ingest(service, range(12))
    building, release = threading.Event(), threading.Event()
    encode_ = snapshots.encode

    def slow_encode(*args):
        building.set()
        release.wait(30)
        return encode_(*args)

    monkeypatch.setattr(snapshots, "encode", slow_encode)
    writer = threading.Thread(target=service.write_snapshot)
    writer.start()
    try:
        assert building.wait(30)
        assert service.lock.acquire(blocking=False)  # free while the snapshot is built
        service.lock.release()
        _ingest(service, range(12, 13))  # ingestion and queries go on meanwhile
        assert service.contributions(Features.of([0], ["k3"]), 40).estimate.c_hat.size == 1
        assert service.observations == 1300
    finally:
        release.set()
        writer.join(30)
    assert _snapshot_rows(service.settings.database_url) == [(800, snapshots.SNAPSHOT_FORMAT)]
    service.engine.dispose()
