"""Inputs that used to get through, or to give 503: each is now a 422 naming the field."""

import json

import pytest
from fastapi.testclient import TestClient

from predictor.app import create_app
from predictor.settings import Settings


@pytest.fixture
def client(tmp_path):
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'h.db'}"))) as c:
        yield c


def post(client, path, body):
    """JSON with escapes, as a client would send a lone surrogate (\\ud800)."""
    return client.post(path, content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"})


@pytest.mark.parametrize("field, value", [
    ("request_id", "a\x00b"), ("prompt_key", "k\x00"), ("request_id", "\ud800"),
    ("prompt", "text \udfff"), ("completed_at", 0), ("completed_at", 1.5e9)])
def test_observation_fields(client, field, value):
    item = {"request_id": "r1", "output_tokens": 5, field: value}
    answer = post(client, "/v1/observations", {"observations": [item]})
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"][:4] == ["body", "observations", 0, field]
    assert client.get("/v1/status").json()["observations"] == 0


@pytest.mark.parametrize("field, value", [("request_id", "x\x00"), ("prompt_key", "\ud83d")])
def test_contribution_fields(client, field, value):
    item = {"request_id": "r1", "generated_tokens": 0, field: value}
    answer = post(client, "/v1/contributions", {"items": [item]})
    assert answer.status_code == 422
    error = answer.json()["detail"][0]
    # this hot path parses the bytes itself: a lone surrogate is already invalid JSON there
    assert error["loc"][-1] == field or error["type"] == "json_invalid"


def test_huge_numbers_in_an_ab_trace(client):
    content = "arrival_s,prompt_tokens,output_tokens\n0,10,1000000000000000000000000000000\n"
    answer = client.post("/v1/ab-comparisons", json={"trace": {"format": "csv",
                                                                "content": content}})
    assert answer.status_code == 422
    assert "line 2" in answer.json()["detail"][0]["msg"]


def test_calibration_bin_edges_are_rounded(client):
    bins = client.get("/v1/calibration").json()["estimators"][0]["bins"]
    assert [b["lo"] for b in bins][:4] == [0.0, 0.1, 0.2, 0.3]
