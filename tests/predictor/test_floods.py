"""Floods of valid but hostile input against a real ``balanceroute serve`` process on
127.0.0.1: its memory (peak resident set, ``VmHWM``) stays under the budget the README
documents. Bounded in count; no wall-clock assertions."""

from pathlib import Path

import httpx
import pytest

from predictor.livesrv import live_process

# The README's budget ("Memory" in the prediction service's sections): peak RSS of a serve
# process with every estimator, whatever the lengths and the keys' number.
RSS_BUDGET_MB = 512

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def test_poisoned_keys_flood_stays_under_the_memory_budget(tmp_path):
    keys, per_batch = 6000, 1000
    with live_process(f"sqlite:///{tmp_path / 'p.db'}") as (base, process), \
            httpx.Client(base_url=base, timeout=120) as client:
        for start in range(0, keys, per_batch):
            batch = [{"request_id": f"p{i}", "prompt_key": f"poison-{i}",
                      "output_tokens": 1_048_576 - i, "finish_reason": "length"}
                     for i in range(start, start + per_batch)]
            got = client.post("/v1/observations", json={"observations": batch})
            assert got.status_code == 200, got.text
        answer = client.post("/v1/contributions", json={"estimator": "exact_match", "items": [
            {"request_id": "q", "prompt_key": "poison-5999", "generated_tokens": 1_000_000}]})
        assert answer.status_code == 200
        assert answer.json()["items"][0]["estimator"] == "exact_match"
        status = client.get("/v1/status").json()
        assert status["observations"] == keys
        peak = peak_rss_mb(process.pid)
    print(f"poisoned-key flood: {keys} keys near 1,048,576 tokens, peak RSS {peak:.0f} MB")
    assert peak < RSS_BUDGET_MB


def test_exact_match_junk_query_flood_stays_under_the_memory_budget(tmp_path):
    keys, per_batch, queries, items = 50_000, 10_000, 4, 50_000
    with live_process(f"sqlite:///{tmp_path / 'j.db'}",
                      env={"BALANCEROUTE_ESTIMATORS": "survival,exact_match"}) as (
            base, process), httpx.Client(base_url=base, timeout=300) as client:
        for start in range(0, keys, per_batch):
            batch = [{"request_id": f"o{i}", "prompt_key": f"key-{i}",
                      "output_tokens": 1 + (i * 7919) % 20_000, "finish_reason": "stop"}
                     for i in range(start, start + per_batch)]
            assert client.post("/v1/observations",
                               json={"observations": batch}).status_code == 200
        for q in range(queries):
            body = {"estimator": "exact_match", "horizon": 4096, "items": [
                {"request_id": f"junk{q}-{i}", "prompt_key": f"key-{(i + q * items) % keys}",
                 "generated_tokens": 1_000_000 - i} for i in range(items)]}
            got = client.post("/v1/contributions", json=body)
            assert got.status_code == 200
            assert {i["estimator"] for i in got.json()["items"]} == {"exact_match"}
        peak = peak_rss_mb(process.pid)
    print(f"junk-query flood: {queries} x {items} items over {keys} keys, peak RSS {peak:.0f} MB")
    assert peak < RSS_BUDGET_MB


def test_bodies_of_unknown_fields_are_refused_cheaply(tmp_path):
    """Bodies within the size limit whose objects carry millions of unknown fields in all
    (4,000 items of 700 made-up keys, 23 MB). A schema that forbids unknown keys made one
    error per key: a 280-300 MB 422 after about a minute, the service's peak RSS 4-6 GB. Now
    each object with unknown fields is one error naming the first ten (the 422 lists them
    at their own locations), and a list stops at its first bad entry."""
    extra = b",".join(b'"x%d":0' % k for k in range(700))
    observation = b'{"request_id":"a","output_tokens":5,' + extra + b"}"
    item = b'{"request_id":"a","generated_tokens":1,' + extra + b"}"
    bodies = {"/v1/observations": b'{"observations":[' + b",".join([observation] * 4000) + b"]}",
              "/v1/contributions": b'{"items":[' + b",".join([item] * 4000) + b"]}"}
    with live_process(f"sqlite:///{tmp_path / 'u.db'}") as (base, process), \
            httpx.Client(base_url=base, timeout=300) as client:
        for path, body in bodies.items():
            assert len(body) > 20_000_000
            got = client.post(path, content=body, headers={"content-type": "application/json"})
            assert got.status_code == 422, got.text[:500]
            assert len(got.content) < 4096, len(got.content)
            detail = got.json()["detail"]
            field = "observations" if path == "/v1/observations" else "items"
            assert [e["loc"] for e in detail[:10]] == [["body", field, 0, f"x{k}"]
                                                       for k in range(10)]
            # the observations stop at their first bad entry; the contributions (read whole,
            # unknown fields let in, then checked) count every one
            more = 690 if path == "/v1/observations" else 4000 * 700 - 10
            assert detail[10]["msg"] == f"{more} more unknown fields, not listed"
            assert len(detail) == 11
        assert client.get("/v1/status").json()["observations"] == 0
        peak = peak_rss_mb(process.pid)
    print(f"unknown-field bodies: peak RSS {peak:.0f} MB")
    assert peak < 2 * RSS_BUDGET_MB


def test_concurrent_oversized_batches_are_refused_within_the_memory_budget(tmp_path):
    """Sixteen bodies of 200,000 valid observations each (25 MB; the batch limit is 10,000)
    at once from four loopback addresses: every one a 413, the service's peak RSS within
    twice the budget. Each used to be parsed and validated whole, all at once, before its
    count was checked (peak 2.1 GB, 41 s); now the bodies wait their turn as bytes, and the
    count is checked as soon as the JSON is decoded."""
    import json
    import threading

    observations = [{"request_id": f"r-{i:09d}", "prompt_key": f"key-{i % 5000}",
                     "prompt_tokens": 900 + i % 77, "output_tokens": 100 + i % 300,
                     "finish_reason": "stop"} for i in range(200_000)]
    body = json.dumps({"observations": observations}).encode()
    del observations
    statuses: list[int] = []
    with live_process(f"sqlite:///{tmp_path / 'b.db'}") as (base, process):
        def send(k: int) -> None:
            transport = httpx.HTTPTransport(local_address=f"127.0.0.{2 + k % 4}")
            with httpx.Client(transport=transport, timeout=300) as client:
                statuses.append(client.post(base + "/v1/observations", content=body, headers={
                    "content-type": "application/json"}).status_code)

        threads = [threading.Thread(target=send, args=(k,)) for k in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        small = httpx.post(base + "/v1/observations", json={"observations": [
            {"request_id": "after", "output_tokens": 3}]})
        assert small.json() == {"accepted": 1, "duplicates": 0}
        peak = peak_rss_mb(process.pid)
    print(f"16 oversized batches at once: peak RSS {peak:.0f} MB")
    assert statuses == [413] * 16
    assert peak < 2 * RSS_BUDGET_MB


def test_concurrent_oversized_uploaded_traces_are_refused_within_bounds(tmp_path):
    """Sixteen A/B comparisons at once, each uploading a CSV trace of 1,000,000 requests
    (17 MB; at most 200,000 are replayed) from four loopback addresses: every one a 422, the
    peak RSS under three times the budget (the bodies held, as bytes and as the parsed
    string, and two traces parsed at a time). Each trace used to be parsed whole, all at
    once, before its length was checked (peak 3.6 GB, 88 s); now at most 200,001 rows are
    parsed, INGEST_CONCURRENCY traces at a time."""
    import json
    import threading

    rows = "".join(f"{i * 0.01:.2f},{900 + i % 77},{100 + i % 300}\n" for i in range(1_000_000))
    body = json.dumps({"policies": ["br0"], "trace": {
        "format": "csv", "content": "arrival_s,prompt_tokens,output_tokens\n" + rows}}).encode()
    del rows
    answers: list[tuple[int, str]] = []
    with live_process(f"sqlite:///{tmp_path / 't.db'}") as (base, process):
        def send(k: int) -> None:
            transport = httpx.HTTPTransport(local_address=f"127.0.0.{2 + k % 4}")
            with httpx.Client(transport=transport, timeout=300) as client:
                got = client.post(base + "/v1/ab-comparisons", content=body,
                                  headers={"content-type": "application/json"})
                answers.append((got.status_code, got.json()["detail"][0]["msg"]))

        threads = [threading.Thread(target=send, args=(k,)) for k in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert httpx.get(base + "/v1/ab-comparisons").json() == []  # nothing queued
        peak = peak_rss_mb(process.pid)
    print(f"16 oversized traces at once: peak RSS {peak:.0f} MB")
    assert answers == [(422, "more than 200000 requests; at most 200000 (requests keeps the "
                              "first ones)")] * 16
    assert peak < 3 * RSS_BUDGET_MB
