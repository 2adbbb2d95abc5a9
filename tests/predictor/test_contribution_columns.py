"""``POST /v1/contributions`` with ``columns``: the same answers as ``items``, in columns."""

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.app import create_app
from predictor.settings import Settings


@pytest.fixture
def client(tmp_path):
    config = Settings(database_url=f"sqlite:///{tmp_path / 'service.db'}",
                        exact_match_min_support=2, max_items_per_query=50)
    with TestClient(create_app(config)) as c:
        observations = [
            {"request_id": f"t{i}", "prompt_key": "tpl", "prompt_tokens": 100,
             "output_tokens": 5 + i, "finish_reason": "stop"} for i in range(4)] + [
            {"request_id": f"o{i}", "prompt_tokens": 300, "output_tokens": 40 + 10 * i,
             "finish_reason": "length" if i == 3 else "stop"} for i in range(6)] + [
            {"request_id": f"p{i}", "prompt": "some text", "output_tokens": 3 + i,
             "finish_reason": "stop"} for i in range(3)]  # a key known only by its text
        assert c.post("/v1/observations", json={"observations": observations}).status_code == 200
        yield c


ITEMS = [
    {"request_id": "a", "prompt_key": "tpl", "prompt_tokens": 100, "generated_tokens": 2},
    {"request_id": "b", "prompt_key": "new", "generated_tokens": 0},
    {"request_id": "c", "prompt": "some text", "prompt_tokens": 50, "generated_tokens": 45},
    {"request_id": "d", "generated_tokens": 500},
]


def as_columns(items):
    """The items as columns: a missing field is null in its column."""
    fields = ("request_id", "prompt_key", "prompt", "prompt_tokens", "generated_tokens")
    return {f: [i.get(f) for i in items] for f in fields}


@pytest.mark.parametrize("estimator", ["auto", "survival", "exact_match", "hazard"])
def test_columns_answer_what_items_answer(client, estimator):
    by_items = client.post("/v1/contributions", json={
        "horizon": 40, "estimator": estimator, "items": ITEMS})
    by_columns = client.post("/v1/contributions", json={
        "horizon": 40, "estimator": estimator, "columns": as_columns(ITEMS)})
    assert by_items.status_code == by_columns.status_code == 200
    items, columns = by_items.json(), by_columns.json()
    assert "columns" not in items and "items" not in columns
    assert {k: v for k, v in items.items() if k != "items"} == {
        k: v for k, v in columns.items() if k != "columns"}
    expected = {f: [i[f] for i in items["items"]] for f in
                ("request_id", "c_hat", "p_fin", "mu_rem", "estimator", "support")}
    assert columns["columns"] == expected
    assert columns["columns"]["request_id"] == ["a", "b", "c", "d"]
    # the prompt's text stands for its key, and the learned key answers, in both layouts
    if estimator == "auto":
        assert columns["columns"]["estimator"][:3] == ["exact_match", "survival", "exact_match"]
        assert columns["columns"]["support"][2] == 3


def test_both_layouts_answer_the_documented_fields_in_order(client):
    """The answer's item objects and columns carry exactly the fields of the response
    models (the OpenAPI schema), in their order: the answer is built by hand, not by them."""
    from predictor.schemas import ContributionColumnsOut, ContributionOut

    by_items = client.post("/v1/contributions", json={"horizon": 40, "items": ITEMS}).json()
    by_columns = client.post("/v1/contributions",
                             json={"horizon": 40, "columns": as_columns(ITEMS)}).json()
    for item in by_items["items"]:
        assert list(item) == list(ContributionOut.model_fields)
        ContributionOut.model_validate(item, strict=True)
    assert list(by_columns["columns"]) == list(ContributionColumnsOut.model_fields)
    ContributionColumnsOut.model_validate(by_columns["columns"], strict=True)


def test_columns_may_leave_out_optional_fields(client):
    bare = client.post("/v1/contributions", json={"columns": {
        "request_id": ["a", "b"], "generated_tokens": [0, 7]}})
    same = client.post("/v1/contributions", json={"items": [
        {"request_id": "a", "generated_tokens": 0}, {"request_id": "b", "generated_tokens": 7}]})
    assert bare.status_code == 200
    assert bare.json()["columns"]["c_hat"] == [i["c_hat"] for i in same.json()["items"]]
    empty = client.post("/v1/contributions", json={"columns": {
        "request_id": [], "generated_tokens": []}})
    assert empty.status_code == 200 and empty.json()["columns"]["request_id"] == []


@pytest.mark.parametrize("body, loc, words", [
    ({"columns": {"request_id": ["a", "b"], "generated_tokens": [1]}},
     ["body", "columns", "generated_tokens"], "has 1 entries; request_id has 2"),
    ({"columns": {"request_id": ["a"], "prompt_key": ["k", "l"], "generated_tokens": [1]}},
     ["body", "columns", "prompt_key"], "has 2 entries; request_id has 1"),
    ({"columns": {"request_id": ["a", "b"], "generated_tokens": [1, -3]}},
     ["body", "columns", "generated_tokens", 1], "greater than or equal to 0"),
    ({"columns": {"request_id": ["a"], "generated_tokens": [1], "output_tokens": [3]}},
     ["body", "columns", "output_tokens"], "Extra inputs are not permitted"),
    ({"columns": {"generated_tokens": [1]}}, ["body", "columns", "request_id"], "required"),
    ({"items": [{"request_id": "a", "generated_tokens": 1}],
      "columns": {"request_id": ["a"], "generated_tokens": [1]}}, ["body"], "exactly one"),
    ({"horizon": 40}, ["body"], "exactly one"),
])
def test_bad_columns_say_which_field(client, body, loc, words):
    got = client.post("/v1/contributions", json=body)
    assert got.status_code == 422
    detail = got.json()["detail"]
    assert detail[0]["loc"] == loc and words in detail[0]["msg"]
    # nothing was learned or lost: the service still answers
    assert client.post("/v1/contributions", json={"columns": {
        "request_id": ["z"], "generated_tokens": [0]}}).status_code == 200


def test_columns_past_the_item_limit_are_refused(client):
    n = 51  # the fixture's limit is 50
    got = client.post("/v1/contributions", json={"columns": {
        "request_id": [f"r{i}" for i in range(n)], "generated_tokens": [0] * n}})
    assert got.status_code == 413 and "51 items" in got.json()["detail"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.fixed_dictionaries({
    "request_id": st.text(min_size=1, max_size=5),
    "generated_tokens": st.integers(0, 10_000)}, optional={
    "prompt_key": st.none() | st.sampled_from(["k1", "k2"]),
    "prompt": st.none() | st.sampled_from(["text a", "text b"]),
    "prompt_tokens": st.integers(0, 5000)}), max_size=8), st.booleans())
def test_both_layouts_give_the_estimators_the_same_features(items, all_columns):
    """What the estimators and the calibration sample see is the same in both layouts: ids,
    ages, keys (a text hashed where no key is given) and prompt lengths (unknown: -1, from an
    absent field as from a null in its column)."""
    from predictor.api.contributions import _active_requests
    from predictor.estimators import UNKNOWN_TOKENS

    fields = ["request_id", "prompt_key", "prompt", "prompt_tokens", "generated_tokens"]
    if not all_columns:  # a column only where some item has the field
        fields = [f for f in fields if f in ("request_id", "generated_tokens")
                  or any(f in i for i in items)]
    columns = {f: [i.get(f) for i in items] for f in fields}
    ids_i, by_items, _ = _active_requests({"items": items}, 100)
    ids_c, by_columns, columnar = _active_requests({"columns": columns}, 100)
    assert columnar and ids_i == ids_c == [i["request_id"] for i in items]
    assert by_items.generated.tolist() == by_columns.generated.tolist()
    assert list(by_items.prompt_key) == list(by_columns.prompt_key)
    assert by_items.prompt_tokens.tolist() == by_columns.prompt_tokens.tolist() == [
        i.get("prompt_tokens", UNKNOWN_TOKENS) for i in items]
