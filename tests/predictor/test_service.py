import json
import logging

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, text

from predictor.app import create_app
from predictor.settings import Settings
from router_client.traces import key_of_text


def make_settings(tmp_path, **overrides):
    return Settings(database_url=f"sqlite:///{tmp_path / 'service.db'}", **overrides)


def settings_at(url, **overrides):
    return Settings(database_url=url, **overrides)


@pytest.fixture
def client(tmp_path):
    with TestClient(create_app(make_settings(tmp_path))) as c:
        yield c


def obs(rid, out, reason="stop", key=None, **extra):
    body = {"request_id": rid, "prompt_tokens": 100, "output_tokens": out,
            "finish_reason": reason, **extra}
    if key is not None:
        body["prompt_key"] = key
    return body


def test_no_history_answers_the_conservative_prior(client):
    got = client.post("/v1/contributions", json={"items": [
        {"request_id": "r1", "generated_tokens": 0}, {"request_id": "r2", "generated_tokens": 9}]})
    assert got.status_code == 200
    body = got.json()
    assert body["horizon"] == 80 and body["model_version"] == 0 and body["drifted"] is False
    assert [i["request_id"] for i in body["items"]] == ["r1", "r2"]
    for item in body["items"]:
        assert item == {"request_id": item["request_id"], "c_hat": 80.0, "p_fin": 0.0,
                        "mu_rem": None, "estimator": "prior", "support": 0}


def test_learns_with_censoring_and_answers_in_order(client):
    # outputs 10 (finished) and 20 (cut by max_tokens); the two queried requests are running
    # (censored at 3, and at 30, which counts as just past the longest output): at 10 three
    # are at risk and one ends, so S = 1 below 10 and 2/3 from 10 on, flat
    got = client.post("/v1/observations", json={"observations": [
        obs("a", 10), obs("b", 20, "length")]})
    assert got.json() == {"accepted": 2, "duplicates": 0}
    body = client.post("/v1/contributions", json={"horizon": 80, "items": [
        {"request_id": "x", "generated_tokens": 3}, {"request_id": "y", "generated_tokens": 30}]}
    ).json()
    x, y = body["items"]
    assert x["c_hat"] == pytest.approx(7 + 73 * 2 / 3) and x["p_fin"] == pytest.approx(1 / 3)
    assert x["mu_rem"] == pytest.approx(7.0) and x["estimator"] == "survival"
    assert y["c_hat"] == pytest.approx(80) and y["p_fin"] == pytest.approx(0)
    assert y["mu_rem"] is None
    assert body["model_version"] == 1


def test_exact_match_with_support_else_survival(tmp_path):
    with TestClient(create_app(make_settings(tmp_path, exact_match_min_support=3))) as c:
        c.post("/v1/observations", json={"observations": [
            obs(f"t{i}", 5, key="tpl") for i in range(3)] + [obs(f"o{i}", 50) for i in range(3)]})
        items = [{"request_id": "1", "prompt_key": "tpl", "generated_tokens": 0},
                 {"request_id": "2", "prompt_key": "new", "generated_tokens": 0},
                 {"request_id": "3", "prompt": "some text", "generated_tokens": 0}]
        auto = c.post("/v1/contributions", json={"items": items}).json()["items"]
        assert [i["estimator"] for i in auto] == ["exact_match", "survival", "survival"]
        # the key's curve (always 5) shrunk toward the global one (5 + 45 * 0.5) with k = 1
        assert auto[0]["c_hat"] == pytest.approx((3 * 5 + 27.5) / 4)
        assert auto[0]["support"] == 3
        surv = c.post("/v1/contributions", json={"items": items, "estimator": "survival"})
        assert {i["estimator"] for i in surv.json()["items"]} == {"survival"}
        assert c.get("/v1/status").json()["buckets"] == 1


def test_prompt_text_and_keys_in_one_query(client):
    """Items with a key, with a prompt's text (hashed to its key) and with neither."""
    client.post("/v1/observations", json={"observations": [
        obs("t1", 5, prompt="the text"), obs("k1", 9, key="tpl"), obs("o1", 50)]})
    items = [{"request_id": "1", "prompt_key": "tpl", "generated_tokens": 0},
             {"request_id": "2", "prompt": "the text", "generated_tokens": 0},
             {"request_id": "3", "generated_tokens": 0},
             {"request_id": "4", "prompt_key": key_of_text("the text"), "generated_tokens": 0}]
    answer = client.post("/v1/contributions", json={"items": items}).json()["items"]
    assert [i["estimator"] for i in answer] == ["exact_match", "exact_match", "survival",
                                                "exact_match"]
    assert answer[1]["c_hat"] == answer[3]["c_hat"] != answer[0]["c_hat"]


def test_prompt_text_is_hashed_never_stored_or_logged(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    secret = "my secret prompt text 4f1c"
    settings = make_settings(tmp_path, exact_match_min_support=1)
    with TestClient(create_app(settings)) as c:
        c.post("/v1/observations", json={"observations": [obs("s1", 7, prompt=secret)]})
        got = c.post("/v1/contributions", json={"items": [
            {"request_id": "q", "prompt": secret, "generated_tokens": 0}]}).json()
        assert got["items"][0]["estimator"] == "exact_match"
        bad = c.post("/v1/contributions", json={"items": [
            {"request_id": "q", "prompt": secret, "generated_tokens": -1}]})
        assert bad.status_code == 422 and secret not in bad.text
    engine = create_engine(settings.database_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT * FROM observations")).all()
    engine.dispose()
    assert rows and secret not in repr(rows)
    assert any(key_of_text(secret) in repr(r) for r in rows)
    assert secret not in caplog.text


def test_idempotent_on_request_id(database_url):
    with TestClient(create_app(settings_at(database_url))) as client:
        _check_idempotency(client)


def _check_idempotency(client):
    first = client.post("/v1/observations", json={"observations": [obs("a", 5), obs("b", 6)]})
    assert first.json() == {"accepted": 2, "duplicates": 0}
    again = client.post("/v1/observations", json={"observations": [
        obs("a", 5), obs("c", 7), obs("c", 7)]})
    assert again.json() == {"accepted": 1, "duplicates": 2}
    status = client.get("/v1/status").json()
    assert status["observations"] == 3 and status["model_version"] == 2
    only_dupes = client.post("/v1/observations", json={"observations": [obs("a", 5)]})
    assert only_dupes.json() == {"accepted": 0, "duplicates": 1}
    assert client.get("/v1/status").json()["model_version"] == 2


def test_restart_answers_exactly_as_before(database_url):
    settings = settings_at(database_url, exact_match_min_support=2, history=50,
                           exact_match_max_buckets=4)
    import numpy as np

    rng = np.random.default_rng(0)
    query = {"horizon": 40, "items": [
        {"request_id": f"q{i}", "prompt_key": f"k{i % 7}", "generated_tokens": int(g)}
        for i, g in enumerate(rng.integers(0, 120, 64))]}
    with TestClient(create_app(settings)) as c:
        for batch in range(12):
            c.post("/v1/observations", json={"observations": [
                obs(f"r{batch}-{i}", int(rng.integers(1, 150)),
                    "length" if rng.random() < 0.2 else "stop", key=f"k{rng.integers(0, 7)}")
                for i in range(int(rng.integers(1, 15)))]})
        before = c.post("/v1/contributions", json=query).json()
        status_before = c.get("/v1/status").json()
    with TestClient(create_app(settings)) as c:
        after = c.post("/v1/contributions", json=query).json()
        status_after = c.get("/v1/status").json()
    assert after == before
    for key in ("model_version", "observations", "buckets"):
        assert status_after[key] == status_before[key]
    assert {i["estimator"] for i in before["items"]} >= {"exact_match", "survival"}


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/observations", {"observations": [{"output_tokens": 5}]}, "request_id"),
        ("/v1/observations", {"observations": [obs("x" * 129, 5)]}, "request_id"),
        ("/v1/observations", {"observations": [obs("a", -1)]}, "output_tokens"),
        ("/v1/observations", {"observations": [obs("a", 5.5)]}, "output_tokens"),
        ("/v1/observations", {"observations": [obs("a", 10**12)]}, "output_tokens"),
        ("/v1/observations", {"observations": [obs("a", 5, "done")]}, "finish_reason"),
        ("/v1/observations", {"observations": [obs("a", 5, key="k" * 257)]}, "prompt_key"),
        ("/v1/observations", {"observations": [obs("a", 5, completed_at="noon")]},
         "completed_at"),
        ("/v1/observations", {"observations": [obs("a", 5, colour="red")]}, "colour"),
        ("/v1/observations", {"observations": "nope"}, "observations"),
        ("/v1/contributions", {"horizon": 0, "items": []}, "horizon"),
        ("/v1/contributions", {"horizon": 4097, "items": []}, "horizon"),
        ("/v1/contributions", {"estimator": "magic", "items": []}, "estimator"),
        ("/v1/contributions", {"items": [{"request_id": "a"}]}, "generated_tokens"),
        ("/v1/contributions", {"items": [{"request_id": "a", "generated_tokens": True}]},
         "generated_tokens"),
    ],
)
def test_invalid_input_is_422_naming_the_field(client, path, body, field):
    got = client.post(path, json=body)
    assert got.status_code == 422
    locs = [e["loc"] for e in got.json()["detail"]]
    assert any(field in [str(p) for p in loc] for loc in locs), locs


def test_malformed_json_is_422(client):
    got = client.post("/v1/observations", content=b'{"observations": [',
                      headers={"content-type": "application/json"})
    assert got.status_code == 422


def test_rejected_batch_stores_nothing(database_url):
    with TestClient(create_app(settings_at(database_url))) as client:
        _check_rejected_batch(client)


def _check_rejected_batch(client):
    got = client.post("/v1/observations", json={"observations": [obs("ok", 5), obs("bad", -5)]})
    assert got.status_code == 422
    assert got.json()["detail"][0]["loc"] == ["body", "observations", 1, "output_tokens"]
    assert client.get("/v1/status").json()["observations"] == 0


def test_limits_are_413(tmp_path):
    settings = make_settings(tmp_path, max_observations_per_batch=3, max_items_per_query=2,
                             max_body_bytes=4096)
    with TestClient(create_app(settings)) as c:
        many = c.post("/v1/observations", json={"observations": [obs(f"r{i}", 1)
                                                                 for i in range(4)]})
        assert many.status_code == 413 and "at most 3" in many.text
        items = [{"request_id": str(i), "generated_tokens": 0} for i in range(3)]
        assert c.post("/v1/contributions", json={"items": items}).status_code == 413
        huge = c.post("/v1/observations", content=b"x" * 5000,
                      headers={"content-type": "application/json"})
        assert huge.status_code == 413
        assert c.get("/v1/status").json()["observations"] == 0


def test_token_guards_writes(tmp_path):
    with TestClient(create_app(make_settings(tmp_path, api_token="s3cret"))) as c:
        body = {"observations": [obs("a", 5)]}
        assert c.post("/v1/observations", json=body).status_code == 401
        wrong = c.post("/v1/observations", json=body, headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401
        right = c.post("/v1/observations", json=body,
                       headers={"Authorization": "Bearer s3cret"})
        assert right.status_code == 200
        # reads stay open
        assert c.post("/v1/contributions", json={"items": []}).status_code == 200


def test_service_endpoints_and_metrics(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["database"] is True
    client.post("/v1/observations", json={"observations": [obs("a", 5, key="k")]})
    client.post("/v1/contributions", json={"items": [{"request_id": "a", "generated_tokens": 1}]})
    metrics = client.get("/metrics").text
    for name in ('balanceroute_http_requests_total{endpoint="/v1/observations",method="POST",'
                 'status="200"} 1.0', "balanceroute_observations_ingested_total 1.0",
                 "balanceroute_exact_match_buckets 1.0", "balanceroute_model_version 1.0",
                 "balanceroute_exact_match_hit_rate", "balanceroute_http_request_duration"):
        assert name in metrics
    schema = client.get("/openapi.json").json()
    assert "/v1/contributions" in schema["paths"]
    # the error statuses a route answers are in its document (schemathesis flagged a 404
    # the document did not list)
    paths = schema["paths"]
    for kind in ("ab-comparisons", "tunings"):
        for method in ("get", "delete"):
            assert "404" in paths[f"/v1/{kind}/{{job_id}}"][method]["responses"]
        assert {"401", "413", "422"} <= set(paths[f"/v1/{kind}"]["post"]["responses"])
    assert {"413", "422"} <= set(paths["/v1/contributions"]["post"]["responses"])
    assert {"401", "413", "422"} <= set(paths["/v1/observations"]["post"]["responses"])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["request_id", "observations", "items", "horizon",
                                       "output_tokens", "generated_tokens", "prompt",
                                       "prompt_key", "finish_reason", "estimator", "x"]),
                      children, max_size=5),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=json_values, path=st.sampled_from(["/v1/observations", "/v1/contributions"]))
def test_no_input_causes_a_server_error(client, body, path):
    got = client.post(path, content=json.dumps(body, allow_nan=True),
                      headers={"content-type": "application/json"})
    assert got.status_code in (200, 413, 422), got.text


def test_two_replicas_on_one_database_count_duplicates_and_share_model_version(database_url):
    from predictor.service import PredictorService
    from predictor.settings import Settings
    from predictor.store import make_engine

    replicas = []
    for _ in range(2):
        service = PredictorService(Settings(database_url=database_url),
                                   make_engine(database_url))
        service.load()
        replicas.append(service)
    a, b = replicas
    batch = [{"request_id": f"x{i}", "prompt_key": None, "prompt_tokens": 10,
              "output_tokens": 5 + i, "finish_reason": "stop"} for i in range(20)]
    first = a.ingest(batch)
    second = b.ingest(batch[10:] + [{**batch[0], "request_id": "new"}])
    assert (first.accepted, first.duplicates) == (20, 0)
    assert (second.accepted, second.duplicates) == (1, 10)
    assert second.model_version == first.model_version + 1  # one global count of batches
    for service in replicas:
        service.engine.dispose()


def _templated_rows(spec: str):
    """A synthetic workload and its requests as observations (all ended)."""
    from router_client.synth import synthesize

    trace = synthesize(spec)
    return trace, [{"request_id": f"o{i}", "prompt_key": trace.prompt_keys[i],
                    "prompt_tokens": int(trace.prompt_tokens[i]),
                    "output_tokens": int(trace.output_tokens[i]), "finish_reason": "stop"}
                   for i in range(len(trace))]


def test_hazard_fits_outside_the_query_lock_and_rebuilds_the_same_after_restart(tmp_path):
    import numpy as np

    from predictor.estimators import Features
    from predictor.service import PredictorService
    from predictor.settings import Settings
    from predictor.store import make_engine

    url = f"sqlite:///{tmp_path / 'hz.db'}"
    trace, rows = _templated_rows("synth:templated:n=700,seed=3")
    features = Features.of([0, 10, 50], trace.prompt_keys[:3], trace.prompt_tokens[:3])
    answers = []
    for restart in range(2):
        service = PredictorService(Settings(database_url=url), make_engine(url))
        service.load()
        hazard = service.estimators["hazard"]
        assert hazard.defer_fits
        if restart == 0:
            for start in range(0, len(rows), 100):
                service.ingest(rows[start:start + 100])
                service.wait_for_fits()  # as a slow ingestion would: no fit is coalesced
        assert hazard.n_fits_ >= 2 and hazard.model_ is not None
        answers.append(service.contributions(features, 80, "hazard").estimate.c_hat)
        service.engine.dispose()
    np.testing.assert_array_equal(answers[0], answers[1])


def test_k_is_estimated_off_the_query_lock_and_ends_as_estimated_inline(tmp_path):
    """ExactMatch's k (and the hazard model's key curves' k) is estimated on the fitter
    thread, not while an ingestion holds the lock queries take: with the fitter held back the
    batch is learned and k is still the prior; once the deferred work runs k is the one an
    estimator fed the same batch inline has."""
    import threading

    from predictor.estimators import Outcomes, estimator_specs
    from predictor.service import PredictorService
    from predictor.settings import Settings
    from predictor.store import make_engine

    url = f"sqlite:///{tmp_path / 'k.db'}"
    trace, rows = _templated_rows("synth:templated:n=1200,seed=4")
    settings = Settings(database_url=url)
    service = PredictorService(settings, make_engine(url))
    service.load()
    exact, keyed = service.estimators["exact_match"], service.estimators["hazard"].keyed_
    release = threading.Event()
    service.fitter.submit(release.wait, 60)  # the fitter's one thread busy (bounded)
    try:
        assert service.ingest(rows).accepted == 1200
        assert len(exact.buckets_) > 10 and exact.prior_weight_ == keyed.prior_weight_ == 1.0
        assert service.fitting
    finally:
        release.set()  # a failed assertion must not leave the fitter blocked
    service.wait_for_fits()
    inline = {spec.name: spec.build(settings) for spec in estimator_specs()}
    outcomes = Outcomes.of(trace.output_tokens, None, trace.prompt_keys, trace.prompt_tokens)
    for estimator in inline.values():
        estimator.partial_fit(outcomes)
    want = inline["exact_match"].prior_weight_
    assert want != 1.0
    assert exact.prior_weight_ == want
    assert keyed.prior_weight_ == inline["hazard"].keyed_.prior_weight_
    service.engine.dispose()


def test_restart_replays_only_what_the_learners_keep(database_url):
    """With more stored than ``replay_observations``, the newest are replayed in full and the
    older ones only for the keys' state (no snapshot here: one scan of them, see
    test_snapshots.py for the snapshots): the global window and every key's bucket are as
    before the restart, so are k and the answers; the hazard model's per-key sums are equal
    bit for bit."""
    import numpy as np

    settings = settings_at(database_url, history=300, replay_observations=400,
                           exact_match_bucket_window=8, hazard_refit_every=100_000,
                           snapshot_every=0)
    rng = np.random.default_rng(3)
    query = {"horizon": 40, "estimator": "exact_match", "items": [
        {"request_id": f"q{i}", "prompt_key": f"k{i % 40}", "generated_tokens": int(g)}
        for i, g in enumerate(rng.integers(0, 120, 80))]}
    with TestClient(create_app(settings)) as c:
        for batch in range(20):  # keys k0..k19 only in the first half, k20..k39 after
            keys = range(0, 20) if batch < 10 else range(20, 40)
            c.post("/v1/observations", json={"observations": [
                obs(f"r{batch}-{i}", int(rng.integers(1, 150)),
                    "length" if rng.random() < 0.2 else "stop", key=f"k{rng.choice(keys)}")
                for i in range(100)]})
        c.app.state.service.wait_for_fits()  # k's last estimate installed (off the lock)
        before = c.post("/v1/contributions", json=query).json()
        status_before = c.get("/v1/status").json()
        buckets = [(k, b.durations.tolist(), b.bins.tolist()) for k, b in
                   c.app.state.service.estimators["exact_match"].buckets_.items()]
        keys = c.app.state.service.estimators["hazard"].keys_
    with TestClient(create_app(settings)) as c:
        service = c.app.state.service
        assert service.last_id == 2000
        rebuilt = [(k, b.durations.tolist(), b.bins.tolist()) for k, b in
                   service.estimators["exact_match"].buckets_.items()]
        sums = service.estimators["hazard"].keys_
        assert list(sums.table.items()) == list(keys.table.items())  # in the same order
        assert (sums.ended, sums.total) == (keys.ended, keys.total)
        after = c.post("/v1/contributions", json=query).json()
        status_after = c.get("/v1/status").json()
    assert rebuilt == buckets
    assert after == before
    for key in ("model_version", "observations", "buckets"):
        assert status_after[key] == status_before[key]


def test_status_says_when_a_model_fit_is_queued_or_running(client):
    """``fitting`` while the fitter thread has a fit queued (held back here behind a task that
    waits) or running (one that waits too); false once it is done."""
    import threading

    service = client.app.state.service
    assert client.get("/v1/status").json()["fitting"] is False
    release, running, fit_goes_on = threading.Event(), threading.Event(), threading.Event()
    service.fitter.submit(release.wait, 60)  # the fitter's one thread busy: the fit waits
    try:
        service._schedule_fits()
        assert client.get("/v1/status").json()["fitting"] is True  # queued
        service._fit_deferred = lambda: (running.set(), fit_goes_on.wait(60))  # runs on
        release.set()
        assert running.wait(timeout=10)
        assert not service._fit_queued  # no longer queued, but running
        assert client.get("/v1/status").json()["fitting"] is True
    finally:  # a failed assertion must not leave the fitter blocked
        release.set()
        fit_goes_on.set()
    service.wait_for_fits()
    assert client.get("/v1/status").json()["fitting"] is False
