"""``HttpPredictor`` asks in columns, and falls back to items for a service without them."""

import httpx
import numpy as np
import orjson
import pytest

from predictor.livesrv import live_server
from router_client.http_predictor import HttpPredictor
from router_client.predictors import ActiveBatch

BATCH = ActiveBatch(request_ids=np.array([7, 8, 9, 10]), prompt_tokens=np.array([100, 300, 0, 5]),
                    generated_tokens=np.array([2, 0, 45, 500]),
                    prompt_keys=["tpl", "new", None, "tpl"])


def observations():
    return [{"request_id": f"t{i}", "prompt_key": "tpl", "prompt_tokens": 100,
             "output_tokens": 5 + i, "finish_reason": "stop"} for i in range(10)] + [
        {"request_id": f"o{i}", "prompt_tokens": 300, "output_tokens": 40 + 10 * i,
         "finish_reason": "stop"} for i in range(10)]


def test_columns_give_the_answers_items_give(tmp_path):
    with live_server(f"sqlite:///{tmp_path / 'cols.db'}") as url:
        httpx.post(url + "/v1/observations", json={"observations": observations()}
                   ).raise_for_status()
        predictor = HttpPredictor(url, "auto", id_prefix="p-", report="sync")
        got = predictor.predict(BATCH, 40)
        items = [{"request_id": f"p-{r}", "prompt_key": k, "prompt_tokens": int(p),
                  "generated_tokens": int(g)} for r, k, p, g in zip(
            BATCH.request_ids, BATCH.prompt_keys, BATCH.prompt_tokens, BATCH.generated_tokens,
            strict=True)]
        for item in items:
            if item["prompt_key"] is None:
                del item["prompt_key"]
        answer = httpx.post(url + "/v1/contributions", json={"horizon": 40, "items": items}
                            ).json()["items"]
        predictor.close()
    assert predictor.columnar and predictor.failures == 0
    assert got.c_hat.tolist() == [i["c_hat"] for i in answer]
    assert got.p_fin.tolist() == [i["p_fin"] for i in answer]
    assert np.array_equal(got.mu_rem, np.array([i["mu_rem"] for i in answer], dtype=float),
                          equal_nan=True)
    assert [i["estimator"] for i in answer][:2] == ["exact_match", "survival"]


def test_a_bad_query_is_a_failure_not_a_switch_to_items(tmp_path):
    with live_server(f"sqlite:///{tmp_path / 'bad.db'}") as url:
        predictor = HttpPredictor(url, "no_such_estimator", report="sync")
        assert predictor.predict(BATCH, 40).c_hat is None  # 422: BR-0 this round
        predictor.close()
    assert predictor.columnar and predictor.failures == 1
    assert "422" in predictor.last_error


def older_service(seen: list):
    """The contract before columns (an older service: items only, extra fields refused).
    No such service can be started here, so this transport answers as it did."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        seen.append(sorted(body))
        if "columns" in body:
            return httpx.Response(422, json={"detail": [
                {"type": "missing", "loc": ["body", "items"], "msg": "Field required"},
                {"type": "extra_forbidden", "loc": ["body", "columns"],
                 "msg": "Extra inputs are not permitted"}]})
        return httpx.Response(200, json={
            "horizon": body["horizon"], "model_version": 3, "drifted": False,
            "recommendation": None, "items": [
                {"request_id": i["request_id"], "c_hat": float(i["generated_tokens"] % 40),
                 "p_fin": 0.5, "mu_rem": None if i["generated_tokens"] == 0 else 3.0,
                 "estimator": "survival", "support": 9} for i in body["items"]]})

    return handle


def test_a_service_without_columns_is_asked_with_items_from_then_on():
    seen: list = []
    predictor = HttpPredictor("http://127.0.0.1:9", report="sync")
    predictor.client = httpx.Client(base_url="http://127.0.0.1:9",
                                    transport=httpx.MockTransport(older_service(seen)))
    first = predictor.predict(BATCH, 40)
    second = predictor.predict(BATCH, 40)
    assert predictor.close()["dropped"] == 0  # nothing to report: no other traffic
    assert first.c_hat.tolist() == second.c_hat.tolist() == [2.0, 0.0, 5.0, 20.0]
    assert np.array_equal(first.mu_rem, [3.0, np.nan, 3.0, 3.0], equal_nan=True)
    # columns once, refused; items at once, and only items afterwards
    assert [k for k in seen] == [["columns", "estimator", "horizon"],
                                 ["estimator", "horizon", "items"],
                                 ["estimator", "horizon", "items"]]
    assert not predictor.columnar and predictor.failures == 0


def test_columns_are_tried_again_after_a_while(monkeypatch):
    """An upgraded service (a rolling upgrade) gets columns again: every
    COLUMNS_RETRY_EVERY queries the client tries them."""
    import router_client.http_predictor as module

    monkeypatch.setattr(module, "COLUMNS_RETRY_EVERY", 3)
    seen: list = []
    predictor = HttpPredictor("http://127.0.0.1:9", report="sync")
    predictor.client = httpx.Client(base_url="http://127.0.0.1:9",
                                    transport=httpx.MockTransport(older_service(seen)))
    for _ in range(4):
        assert predictor.predict(BATCH, 40).c_hat is not None
    predictor.close()
    layouts = ["columns" if "columns" in keys else "items" for keys in seen]
    assert layouts == ["columns", "items", "items", "columns", "items", "items"]


def answering(body: dict):
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=body)
    return handle


IDS = ["7", "8", "9", "10"]


@pytest.mark.parametrize("columns", [
    {"request_id": IDS, "c_hat": [[1.0, 2.0], [3.0, 4.0]], "p_fin": [0.1] * 4,
     "mu_rem": [1.0] * 4},  # nested, the right total size
    {"request_id": IDS, "c_hat": [1.0, 2.0, 3.0], "p_fin": [0.1] * 4, "mu_rem": [1.0] * 4},
    {"request_id": IDS[::-1], "c_hat": [1.0] * 4, "p_fin": [0.1] * 4, "mu_rem": [1.0] * 4},
    {"request_id": IDS, "c_hat": [1.0, None, 3.0, 4.0], "p_fin": [0.1] * 4,
     "mu_rem": [1.0] * 4},
    {"request_id": IDS, "c_hat": 5.0, "p_fin": [0.1] * 4, "mu_rem": [1.0] * 4},
    {"request_id": IDS, "c_hat": [1.0] * 4, "p_fin": [0.1] * 4},  # mu_rem missing
])
def test_an_answer_that_does_not_fit_is_a_failed_refresh(columns):
    predictor = HttpPredictor("http://127.0.0.1:9", report="sync")
    predictor.client = httpx.Client(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(
        answering({"horizon": 40, "drifted": False, "columns": columns})))
    assert predictor.predict(BATCH, 40).c_hat is None  # BR-0 this round
    predictor.close()
    assert predictor.failures == 1 and predictor.columnar


def test_a_fitting_answer_with_nulls_reads_them_as_unknown():
    predictor = HttpPredictor("http://127.0.0.1:9", report="sync")
    predictor.client = httpx.Client(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(
        answering({"horizon": 40, "drifted": True, "columns": {
            "request_id": IDS, "c_hat": [1.0, 2.0, 3.0, 40.0], "p_fin": [0.5, 0.5, 0.5, 0.0],
            "mu_rem": [1.0, 1.5, 2.0, None]}})))
    got = predictor.predict(BATCH, 40)
    predictor.close()
    assert got.c_hat.tolist() == [1.0, 2.0, 3.0, 40.0] and got.drifted
    assert np.array_equal(got.mu_rem, [1.0, 1.5, 2.0, np.nan], equal_nan=True)
