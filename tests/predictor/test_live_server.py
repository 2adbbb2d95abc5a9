"""End to end against a real uvicorn server on 127.0.0.1 (``balanceroute serve``)."""

import httpx

from predictor.livesrv import live_server


def test_live_server_learns_and_answers_the_same_after_restart(database_url):
    url = database_url
    observations = [
        {"request_id": f"r{i}", "prompt_key": "tpl-a" if i % 2 else "tpl-b",
         "prompt_tokens": 500, "output_tokens": 20 if i % 2 else 200,
         "finish_reason": "length" if i % 10 == 0 else "stop"}
        for i in range(60)
    ]
    query = {"horizon": 64, "items": [
        {"request_id": "a", "prompt_key": "tpl-a", "generated_tokens": 5},
        {"request_id": "b", "prompt_key": "tpl-b", "generated_tokens": 5},
        {"request_id": "c", "prompt": "never seen", "generated_tokens": 5}]}
    with live_server(url) as base, httpx.Client(base_url=base, timeout=10) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        first = client.post("/v1/contributions", json=query).json()
        assert {i["estimator"] for i in first["items"]} == {"prior"}
        stored = client.post("/v1/observations", json={"observations": observations})
        assert stored.json() == {"accepted": 60, "duplicates": 0}
        learned = client.post("/v1/contributions", json=query).json()
        a, b, c = learned["items"]
        assert a["estimator"] == b["estimator"] == "exact_match"
        assert c["estimator"] == "survival"
        assert a["c_hat"] < 20 < b["c_hat"]  # short template ends sooner than the long one
        assert client.get("/v1/status").json()["observations"] == 60
        assert "balanceroute_observations_ingested_total 60.0" in client.get("/metrics").text
    with live_server(url) as base, httpx.Client(base_url=base, timeout=10) as client:
        assert client.post("/v1/contributions", json=query).json() == learned
        again = client.post("/v1/observations", json={"observations": observations[:5]})
        assert again.json() == {"accepted": 0, "duplicates": 5}


def test_live_server_token(tmp_path):
    url = f"sqlite:///{tmp_path / 'tok.db'}"
    body = {"observations": [{"request_id": "x", "output_tokens": 3}]}
    with live_server(url, env={"BALANCEROUTE_API_TOKEN": "t0k"}) as base:
        assert httpx.post(base + "/v1/observations", json=body).status_code == 401
        ok = httpx.post(base + "/v1/observations", json=body,
                        headers={"Authorization": "Bearer t0k"})
        assert ok.status_code == 200
