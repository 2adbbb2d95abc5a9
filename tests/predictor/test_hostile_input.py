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


BODIES = [
    {"items": [{"request_id": "r1", "generated_tokens": 3, "prompt_key": "k"}]},
    {"horizon": 40, "items": [{"request_id": "é\u2603", "generated_tokens": 0, "prompt": "t"}]},
    {"items": [{"request_id": "a\\u0000", "generated_tokens": 1}]},  # a backslash, not a NUL
    {"items": [{"request_id": "x\x00", "generated_tokens": 1}]},
    {"items": [{"request_id": "r", "prompt": "p\x00", "generated_tokens": 1}]},
    {"items": [{"request_id": "", "generated_tokens": -1, "extra": 1}], "horizon": 0},
    {"items": [{"request_id": "r", "generated_tokens": "1"}], "estimator": "nope"},
    {"items": "none"},
    {"columns": {"request_id": ["a", "b"], "prompt_key": ["k", None], "prompt": [None, "t\x00"],
                 "prompt_tokens": [3, None], "generated_tokens": [0, 1]}},
    {"columns": {"request_id": [""], "generated_tokens": [1]}, "horizon": 5000},
    {"columns": {"request_id": "a", "generated_tokens": [True]}},
    {"columns": {"request_id": ["é\u2603"], "generated_tokens": [2], "extra": []}},
]


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("dump", [json.dumps, lambda b: json.dumps(b, ensure_ascii=False)])
def test_contributions_fast_parse_is_the_schema(body, dump):
    """The hot path skips the NUL/surrogate check for bodies without a ``\\u`` escape: same
    value, same errors as the full schema (and its check of unknown fields) on every body."""
    from pydantic import ValidationError

    from predictor.schemas import CONTRIBUTIONS_IN, check_known_fields, parse_contributions

    raw = dump(body).encode("utf-8", "surrogatepass")
    try:
        expected = check_known_fields(CONTRIBUTIONS_IN.validate_json(raw))
    except ValidationError as exc:
        with pytest.raises(ValidationError) as got:
            parse_contributions(raw)
        assert got.value.json() == exc.json()
    else:
        assert parse_contributions(raw) == expected


def test_contributions_fast_schema_matches_the_full_one():
    """The schema without the NUL/surrogate check declares the same fields and limits."""
    from predictor.schemas import _PLAIN_CONTRIBUTIONS_IN, CONTRIBUTIONS_IN

    def shape(schema: dict) -> str:
        text = json.dumps(schema, sort_keys=True)
        return text.replace("_PlainContributionItem", "ContributionItem").replace(
            "_PlainContributionsIn", "ContributionsIn").replace(
            "_PlainContributionColumns", "ContributionColumns")

    full, plain = CONTRIBUTIONS_IN.json_schema(), _PLAIN_CONTRIBUTIONS_IN.json_schema()
    for schema in (full, plain):  # descriptions only document
        schema.pop("description", None)
        for layout in ("items", "columns"):
            schema["properties"][layout].pop("description", None)
        for item in schema["$defs"].values():
            item.pop("description", None)
            for field in item["properties"].values():
                field.pop("description", None)
    assert shape(full) == shape(plain)


@pytest.mark.parametrize("raw", [
    b'{"items": [{"request_id": "a\x00b", "generated_tokens": 1}]}',  # a raw NUL byte
    b'{"items": [{"request_id": "a\x1fb", "generated_tokens": 1}]}',  # a raw control byte
    b'{"items": [{"request_id": "a\xed\xa0\x80b", "generated_tokens": 1}]}',  # lone surrogate
    b'{"items": [{"request_id": "a\xffb", "generated_tokens": 1}]}',  # not UTF-8
])
def test_contributions_fast_parse_refuses_raw_bytes_the_check_would(raw):
    """The fast path's premise: without a ``\\u`` escape, the JSON parser itself refuses a NUL,
    a control character, a lone surrogate or bytes that are not UTF-8."""
    from pydantic import ValidationError

    from predictor.schemas import parse_contributions

    assert b"\\u" not in raw
    with pytest.raises(ValidationError) as got:
        parse_contributions(raw)
    assert got.value.errors()[0]["type"] == "json_invalid"


# Found by fuzzing the live service (schemathesis and hand-made bodies, 2026-12-03): each of
# these was a 503 or a 400, or was accepted and then failed the job with a traceback.
def test_a_trace_nested_past_the_parsers_depth_is_a_422_naming_the_line(client):
    deep = '{"timestamp": 0, "input_length": 1, "output_length": 5, "hash_ids": ' + (
        "[" * 5000 + "]" * 5000 + "}\n")
    content = '{"timestamp": 0, "input_length": 1, "output_length": 5}\n' + deep
    for fmt in ("mooncake", "auto"):
        answer = client.post("/v1/ab-comparisons", json={"trace": {"format": fmt,
                                                                    "content": content}})
        assert answer.status_code == 422, answer.text
        assert "line 2" in answer.text and "nested too deeply" in answer.text


@pytest.mark.parametrize("path", ["/v1/ab-comparisons", "/v1/tunings"])
@pytest.mark.parametrize("field, value", [
    ("load", 1e-42), ("load", 5e-324), ("load", True), ("load", 101), ("load", "0"),
    ("load", "nan"), ("load", "1e-42"), ("seed", -1),
    ("seed", 2**70), ("seed", True), ("step_cost", [0, 0]), ("step_cost", [1e-320, 0]),
    ("step_cost", [1.5e-7, 1e-300]), ("step_cost", [1.5e-7, True])])
def test_replay_parameters_a_job_cannot_run_are_refused_when_posted(client, path, field,
                                                                    value):
    body = {field: value} if path == "/v1/tunings" else {"source": "observations",
                                                          field: value}
    answer = client.post(path, json=body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"][0]["loc"] == ["body", field]
    assert client.get(path).json() == []  # no job was queued


@pytest.mark.parametrize("path", ["/v1/observations", "/v1/ab-comparisons", "/v1/tunings"])
@pytest.mark.parametrize("body, reason", [
    (b'{"observations": "\xff\xfe"}', "not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"seed": 1' + b"0" * 5000 + b"}", "a number with too many digits")])
def test_bodies_that_are_not_json_text_are_a_422_saying_why(client, path, body, reason):
    answer = client.post(path, content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 422
    assert answer.json()["detail"] == [{"loc": ["body"], "type": "json_invalid",
                                        "msg": f"JSON decode error: {reason}"}]


@pytest.mark.parametrize("path, body", [
    ("/v1/observations", b'{"observations": [{"request_id": "a", "output_tokens": 3}]}'),
    ("/v1/ab-comparisons", b'{"source": "observations"}'),
    ("/v1/tunings", b"{}")])
@pytest.mark.parametrize("kind", ["application/x-www-form-urlencoded", "text/plain",
                                  "text/json"])
def test_json_sent_as_another_content_type_is_told_so(client, path, body, kind):
    """``curl -d`` sends its data as a form: the 422 says to send JSON, not that "a valid
    dictionary" was expected; nothing is stored."""
    answer = client.post(path, content=body, headers={"content-type": kind})
    assert answer.status_code == 422
    assert answer.json()["detail"] == [{
        "loc": ["body"], "type": "content_type",
        "msg": f"send the body as JSON with content-type: application/json (this request's: "
               f"{kind})"}]
    assert client.get("/v1/status").json()["observations"] == 0


@pytest.mark.parametrize("kind", ["application/json", "Application/JSON"])
def test_json_that_is_not_an_object_is_not_blamed_on_the_content_type(client, kind):
    answer = client.post("/v1/observations", content=b"[1, 2]", headers={"content-type": kind})
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["type"] != "content_type"
