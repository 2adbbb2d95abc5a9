"""Adding an estimator through the registry alone makes it reachable everywhere: the
contributions API, the calibration report, and ``balanceroute ab --policies brh-<name>``."""

import json
from typing import Self

import numpy as np
import pytest
from fastapi.testclient import TestClient

from predictor import abtest
from predictor.app import create_app
from predictor.cli import main
from predictor.estimators import (
    BaseEstimator,
    Estimate,
    EstimatorSpec,
    Features,
    Outcomes,
    UnknownEstimatorError,
    estimator_spec,
    register_estimator,
    unregister_estimator,
)
from predictor.settings import Settings
from router_client.errors import UnknownPolicyError
from router_client.policies import make_policy, policy_spec


class HalfPrompt(BaseEstimator):
    """A toy: a request lives ``prompt_tokens / 2`` more steps, capped at H (prior if unknown).
    It uses a feature no built-in estimator reads."""

    name = "half_prompt"

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> Self:
        self.seen_ = 0
        return self

    @property
    def n_observed_(self) -> int:
        return self.seen_

    def partial_fit(self, outcomes: Outcomes) -> Self:
        self.seen_ += len(outcomes)
        return self

    def predict(self, features: Features, horizon: int) -> Estimate:
        known = features.prompt_tokens >= 0
        c_hat = np.where(known, np.minimum(features.prompt_tokens / 2.0, horizon), horizon)
        p_fin = np.where(known & (c_hat < horizon), 1.0, 0.0)
        mu = np.where(p_fin > 0, c_hat, np.nan)
        source = [self.name if k else "prior" for k in known.tolist()]
        return Estimate(c_hat, p_fin, mu, source, np.full(len(features), self.seen_))


@pytest.fixture
def toy():
    spec = register_estimator(EstimatorSpec("half_prompt", lambda settings: HalfPrompt()))
    yield spec
    unregister_estimator("half_prompt")


def test_registration_is_all_it_takes(toy, tmp_path):
    assert toy.policy == "brh-half_prompt"
    assert "brh-half_prompt" in abtest.known_policies()
    assert policy_spec("brh-half_prompt").needs_predictions
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'toy.db'}",
                        calibration_sample_rate=1.0)
    with TestClient(create_app(settings)) as client:
        client.post("/v1/observations", json={"observations": [
            {"request_id": f"old{i}", "prompt_tokens": 40, "output_tokens": 20}
            for i in range(5)]}).raise_for_status()
        answer = client.post("/v1/contributions", json={
            "horizon": 80, "estimator": "half_prompt", "items": [
                {"request_id": "a", "prompt_tokens": 30, "generated_tokens": 0},
                {"request_id": "b", "generated_tokens": 0}]}).json()
        assert [i["c_hat"] for i in answer["items"]] == [15.0, 80.0]
        assert [i["estimator"] for i in answer["items"]] == ["half_prompt", "prior"]
        assert "half_prompt" in client.get("/v1/status").json()["estimators"]
        client.post("/v1/observations", json={"observations": [
            {"request_id": "a", "prompt_tokens": 30, "output_tokens": 15}]}).raise_for_status()
        report = client.get("/v1/calibration").json()
        toy_report = {e["estimator"]: e for e in report["estimators"]}["half_prompt"]
        assert toy_report["scored"] == 1 and toy_report["brier"] == 0.0
        filtered = client.get("/v1/calibration", params={"estimator": "half_prompt"}).json()
        assert [e["estimator"] for e in filtered["estimators"]] == ["half_prompt"]

    rows_path = tmp_path / "rows.json"
    code = main(["ab", "--trace", "synth:long:n=300,seed=1", "--workers", "2", "--batch", "8",
                 "--load", "backlog", "--policies", "br0,brh-half_prompt", "--quiet",
                 "--json", str(rows_path)])
    assert code == 0
    rows = json.loads(rows_path.read_text())
    assert [r["policy"] for r in rows] == ["br0", "brh-half_prompt"]
    assert rows[1]["completed"] == 300 and rows[1]["fallback_steps"] == 0


def test_unknown_names_are_clear_errors(tmp_path):
    with pytest.raises(UnknownEstimatorError, match="known: survival, exact_match"):
        estimator_spec("nope")
    with pytest.raises(UnknownPolicyError, match="nope"):
        make_policy("nope")
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'x.db'}")
    with TestClient(create_app(settings)) as client:
        bad = client.post("/v1/contributions", json={
            "estimator": "nope", "items": [{"request_id": "a", "generated_tokens": 0}]})
        assert bad.status_code == 422
        assert bad.json()["detail"][0]["loc"] == ["body", "estimator"]


def test_reserved_names_cannot_be_registered():
    for name in ("auto", "prior", "oracle"):
        with pytest.raises(ValueError, match="reserved"):
            EstimatorSpec(name, lambda settings: HalfPrompt())


def test_a_service_can_run_a_subset_of_the_registry(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path / 's.db'}",
                        estimators="survival,exact_match")
    with TestClient(create_app(settings)) as client:
        assert client.get("/v1/status").json()["estimators"] == ["survival", "exact_match"]
        off = client.post("/v1/contributions", json={
            "estimator": "hazard", "items": [{"request_id": "a", "generated_tokens": 0}]})
        assert off.status_code == 422 and "not run by this service" in off.json()[
            "detail"][0]["msg"]
        names = [e["estimator"] for e in client.get("/v1/calibration").json()["estimators"]]
        assert names == ["survival", "exact_match"]
