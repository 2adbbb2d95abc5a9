"""A decode rank killed mid-run fails only its own in-flight requests; routing continues."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from datetime import UTC
from typing import Any

import httpx
import openai
import pytest

from .conftest import (
    Launcher,
    assert_quiescent,
    free_ports,
    poll_until,
    proxy_state,
    rank_urls,
    scrape,
)


async def _run(proxy_url: str, n: int, max_tokens: int,
               streaming: list[int] | None = None) -> list[str | int]:
    """``n`` streamed completions; ``streaming[0]`` counts those that got a first token."""
    client = openai.AsyncOpenAI(base_url=proxy_url + "/v1", api_key="x", max_retries=0,
                                timeout=60.0)

    async def one() -> str | int:
        tokens = 0
        try:
            stream = await client.completions.create(
                model="m", prompt=[3] * 50, max_tokens=max_tokens, stream=True,
                extra_body={"ignore_eos": True})
            async for c in stream:
                if c.choices and c.choices[0].text:
                    tokens += 1
                    if tokens == 1 and streaming is not None:
                        streaming[0] += 1
            return tokens
        except openai.APIError as exc:
            return f"error: {exc}"

    try:
        return await asyncio.gather(*(one() for _ in range(n)))
    finally:
        await client.close()


def _wait_for(predicate, what: str, timeout_s: float = 15.0):
    return poll_until(predicate, what, timeout_s, interval_s=0.05)


@pytest.mark.timeout(90)
def test_killed_rank_fails_only_its_requests_then_returns(launcher: Launcher):
    healthy = launcher.emulator(workers=2, batch=4, time_scale=1.0)
    doomed = launcher.emulator(workers=1, batch=4, time_scale=1.0)
    proxy = launcher.proxy(rank_urls(healthy, 2) + [doomed.url], policy="br0", batch=4,
                           extra=("--engine-timeout", "10"))
    n, max_tokens = 9, 600

    async def scenario():
        streaming = [0]
        task = asyncio.ensure_future(_run(proxy.url, n, max_tokens, streaming))
        deadline = asyncio.get_running_loop().time() + 15.0
        while streaming[0] < n:  # every stream has begun: none can be routed again
            assert asyncio.get_running_loop().time() < deadline, f"{streaming[0]} of {n} began"
            await asyncio.sleep(0.05)
        per_rank = await asyncio.to_thread(proxy_state, proxy)
        doomed.kill()
        return per_rank["per_rank"], await task

    per_rank, results = asyncio.run(scenario())
    assert per_rank[2] > 0, per_rank
    failed = [r for r in results if isinstance(r, str)]
    assert len(failed) == per_rank[2], results
    assert all(r == max_tokens for r in results if not isinstance(r, str))
    state = assert_quiescent(proxy)
    assert state["up"] == [True, True, False]

    # routing continues on the ranks that are left
    again = asyncio.run(_run(proxy.url, 6, 20))
    assert again == [20] * 6
    assert httpx.get(proxy.url + "/readyz").status_code == 200

    # the rank comes back and is probed up again
    port = int(doomed.url.rsplit(":", 1)[1])
    launcher.emulator(workers=1, batch=4, port=port)
    _wait_for(lambda: proxy_state(proxy)["up"] == [True, True, True], "the rank to return")
    assert asyncio.run(_run(proxy.url, 12, 10)) == [10] * 12
    assert_quiescent(proxy)


@pytest.mark.timeout(60)
def test_ranks_refusing_connections_do_not_fail_requests(launcher: Launcher):
    """Nothing ran on a rank that refused the connection, so the request is routed again, to
    another rank, however many dead ranks it meets first (they do not use up the retries)."""
    doomed = launcher.emulator(workers=3, batch=8, time_scale=1.0)
    healthy = launcher.emulator(workers=2, batch=8, time_scale=1.0)
    proxy = launcher.proxy(rank_urls(doomed, 3) + rank_urls(healthy, 2), policy="br0", batch=8)
    assert proxy_state(proxy)["up"] == [True] * 5
    doomed.kill()  # after the proxy's start check: nothing tells it yet
    # one request alone meets the dead ranks one after another (ties go to the lowest rank)
    assert asyncio.run(_run(proxy.url, 1, 5)) == [5]
    assert asyncio.run(_run(proxy.url, 16, 5)) == [5] * 16
    state = assert_quiescent(proxy)
    assert state["up"] == [False, False, False, True, True]


@pytest.mark.timeout(60)
def test_ranks_dead_at_start_are_down_and_with_none_up_a_request_is_refused_at_once(
        launcher: Launcher):
    """A rank that does not answer when the proxy starts is down from the start (not ready,
    not routed to) until its probe finds it; with no rank up a request gets a 503 at once,
    not after the pool TTL."""
    healthy = launcher.emulator(workers=1, batch=4, time_scale=1.0)
    dead = f"http://127.0.0.1:{free_ports(1)}"  # nothing listens there
    proxy = launcher.proxy([dead, healthy.url], policy="br0", batch=4)
    assert httpx.get(proxy.url + "/readyz").json() == {"ready": True, "up": [False, True]}
    assert "decode rank 0 (http://127.0.0.1:" in proxy.log_tail()  # marked down: start: ...
    assert asyncio.run(_run(proxy.url, 4, 5)) == [5] * 4

    alone = launcher.proxy([dead], policy="br0", batch=4, extra=("--pool-ttl", "30"))
    ready = httpx.get(alone.url + "/readyz")
    assert ready.status_code == 503 and ready.json()["up"] == [False]
    began = time.monotonic()
    refused = httpx.post(alone.url + "/v1/completions", timeout=20.0,
                         json={"model": "m", "prompt": "hi", "max_tokens": 3})
    assert time.monotonic() - began < 10.0  # not the 30 s pool TTL
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["message"] == "no decode rank is up"
    assert_quiescent(alone)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy_guard", [("br0", "idle"), ("br0", "always")])
def test_the_guard_idle_keeps_an_empty_rank_working_while_another_is_down(
        launcher: Launcher, policy_guard):
    """Two ranks of four slots, one down (masked as full): the fleet's free slots (4) never
    exceed ``s_greedy`` (7), so Stage 1 never runs, and with no fixed step cost to weigh
    (``--step-overhead 0``) every 50-token prompt overflows the idle rank's margin (0). The
    guard ``idle`` never holds back a rank that holds nothing: every request completes (it
    once left them all waiting for the pool TTL)."""
    policy, guard = policy_guard
    healthy = launcher.emulator(workers=1, batch=4, time_scale=1.0)
    dead = f"http://127.0.0.1:{free_ports(1)}"  # nothing listens there
    proxy = launcher.proxy([healthy.url, dead], policy=policy, batch=4,
                           extra=("--guard", guard, "--step-overhead", "0", "--pool-ttl", "20"))
    _wait_for(lambda: proxy_state(proxy)["up"] == [True, False], "the dead rank to be marked down")
    assert asyncio.run(_run(proxy.url, 6, 10)) == [10] * 6
    state = assert_quiescent(proxy)
    assert state["up"] == [True, False]


def test_the_proxys_patience_reaches_its_router_and_bad_values_are_refused(capsys):
    """``--patience`` (rounds a rank may wait under the guard ``idle``) reaches the router's
    parameters, kept by the BR-H policy too; a negative or non-integer value is refused with
    the option named (argparse), and so is a negative one given to the config directly."""
    from predictor.cli import main
    from proxy.app import Proxy, ProxyConfig

    for policy, extra in (("br0", {}), ("brh", {"predictor_url": "http://127.0.0.1:9"})):
        proxy = Proxy(ProxyConfig(decode=["http://127.0.0.1:9"], policy=policy, patience=3,
                                  **extra))
        assert proxy.client.config.params.patience == 3
    with pytest.raises(ValueError, match="--patience"):
        ProxyConfig(decode=["http://127.0.0.1:9"], patience=-1)
    for bad in ("-1", "2.5"):
        with pytest.raises(SystemExit) as exc:
            main(["proxy", "--decode", "http://127.0.0.1:9", "--patience", bad])
        assert exc.value.code == 2
        assert "--patience" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_the_proxys_param_options_reach_its_router(launcher: Launcher):
    """``--param NAME=VALUE`` sets BR's other parameters: a real proxy running BR-H (lengths
    from ``max_tokens``) in front of two emulated ranks reports them in ``/proxy/state`` as its
    router runs them, and serves every request."""
    ranks = launcher.emulator(workers=2, batch=4, time_scale=1.0)
    proxy = launcher.proxy(rank_urls(ranks, 2), policy="brh", batch=4, extra=(
        "--lengths-from", "max-tokens", "--param", "horizon=20", "--param", "s_greedy=3",
        "--param", "learned_short_pool=true", "--param", "own_wait_horizon=never",
        "--param", "beta=6.5"))
    params = proxy_state(proxy)["params"]
    assert (params["horizon"], params["s_greedy"], params["learned_short_pool"],
            params["own_wait_horizon"], params["beta"]) == (20, 3, True, None, 6.5)
    assert params["guard"] is None and params["myopic_horizon"] == 1.5  # the rest as default
    assert asyncio.run(_run(proxy.url, 8, 10)) == [10] * 8
    assert assert_quiescent(proxy)["params"] == params


@pytest.mark.parametrize("setting, message", [
    ("nope=1", "--param nope: is not a BR parameter"),
    ("s_greedy=2.5", "--param s_greedy: '2.5' is not a whole number"),
    ("beta=nan", "--param beta: 'nan' is not a number within"),
    ("learned_short_pool=1", "--param learned_short_pool: '1' is not true or false"),
    ("alpha=none", "--param alpha: cannot be unset"),
    ("stage1=sometimes", "--param stage1: must be one of"),
    ("guard=idle", "--param guard: set it with --guard"),
    ("horizon=20", "--param horizon: BR-0 looks no step ahead"),
    ("beta=16", "--param beta: BR-0 (horizon 0) forces beta = G = 1"),
    ("s_greedy", "--param: expected NAME=VALUE"),
    ("end_points=" + "9" * 400, "--param end_points: '999"),
    ("beta=2e6", "--param beta: '2e6' is not a number within +-1e+06"),
])
def test_the_proxys_param_refuses_what_br_cannot_take(capsys, setting, message):
    """A bad ``--param`` stops the proxy before it starts (exit status 2), naming the
    parameter: argparse for the form, the proxy's configuration for the rest."""
    from predictor.cli import main

    try:
        code = main(["proxy", "--decode", "http://127.0.0.1:9", "--param", setting])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--policy", "jsq", "--param", "beta=2"], "--param: --policy jsq has no BR parameters"),
    (["--policy", "brh", "--lengths-from", "max-tokens", "--param", "horizon=5000"],
     "--param horizon: at most 4096"),
])
def test_the_proxys_param_is_for_br_policies_and_service_horizons(capsys, argv, message):
    """A baseline policy takes no ``--param`` (it would be ignored), and a horizon the
    prediction service would refuse is refused at start."""
    from predictor.cli import main

    assert main(["proxy", "--decode", "http://127.0.0.1:9", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["emulate", "--time-scale", "inf"], "--time-scale: must be a finite number > 0"),
    (["emulate", "--time-scale", "nan"], "--time-scale: must be a finite number > 0"),
    (["emulate", "--time-scale", "fast"], "--time-scale: expected a number: 'fast'"),
    (["emulate", "--step-cost", "0,0"], "--step-cost: A and B cannot both be 0"),
    (["proxy", "--decode", "http://127.0.0.1:9", "--step-ms", "inf"],
     "--step-ms: must be a finite number > 0"),
    (["proxy", "--decode", "http://127.0.0.1:9", "--step-overhead", "nan"],
     "--step-overhead: must be >= 0 KV tokens"),
    (["proxy", "--decode", "http://127.0.0.1:9", "--patience", "many"],
     "--patience: expected a whole number of rounds: 'many'"),
    (["proxy", "--decode", "http://127.0.0.1:9", "--max-body-bytes", "100"],
     "--max-body-bytes: must be >= 1024 bytes"),
    (["proxy", "--decode", "http://127.0.0.1:9", "--max-body-bytes", "1e6"],
     "--max-body-bytes: expected a whole number of bytes: '1e6'"),
    (["emulate", "--workers", "0"], "--workers: must be >= 1"),
    (["emulate", "--workers", "2", "--batch", "0"], "--batch: must be >= 1"),
    (["emulate", "--workers", "2", "--port", "99999"], "--port: must be a port, 1 to 65535"),
    (["emulate", "--workers", "2", "--prefill-workers", "-1"], "--prefill-workers: must be >= 0"),
    (["proxy", "--decode", "http://127.0.0.1:9", "--port", "99999"],
     "--port: must be a port, 1 to 65535"),
    (["proxy", "--decode", "http://127.0.0.1:9", "--batch", "0"], "--batch: must be >= 1"),
    (["proxy", "--decode", "http://127.0.0.1:9", "--pool-max", "0"], "--pool-max: must be >= 1"),
    (["proxy", "--decode", "http://127.0.0.1:9", "--start-after", "-1"],
     "--start-after: must be >= 0 requests"),
    (["proxy", "--decode", "http://127.0.0.1:9", "--pool-ttl", "-1"],
     "--pool-ttl: must be a finite number > 0"),
    (["proxy", "--decode", "http://127.0.0.1:9", "--engine-timeout", "0"],
     "--engine-timeout: must be a finite number > 0"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--trace", "synth:long",
      "--max-concurrency", "0"], "--max-concurrency: must be >= 1")])
def test_serving_options_out_of_range_are_refused_naming_the_option(capsys, argv, message):
    from predictor.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@contextlib.contextmanager
def _taken_port() -> Iterator[int]:
    """A port another socket listens on, for as long as the block runs."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        yield taken.getsockname()[1]


def test_emulated_ports_past_65535_or_taken_are_an_error_naming_the_port(capsys):
    from predictor.cli import main

    assert main(["emulate", "--workers", "4", "--port", "65534"]) == 2
    assert "needs ports up to 65537, past 65535" in capsys.readouterr().err
    with _taken_port() as port:
        assert main(["emulate", "--workers", "1", "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_the_proxy_counts_the_ranks_the_guard_holds_back_and_patience_forces():
    """The proxy's routing round (its dispatcher, in process: no timing involved), two ranks
    of four slots, no fixed step cost (``--step-overhead 0``), twelve 50-token prompts in the
    pool. Stage 1 gives rank 0 one request (8 free slots > ``s_greedy`` 7); in Stage 2 rank 1
    (margin 50) takes one that fits, and rank 0, at the maximum, would overflow with any
    (F = 50 - 2 * 50 < 0): ``idle`` holds it back, counted once; with ``--patience 0`` it
    takes its best request instead, counted as patience's."""
    from proxy.app import Proxy, ProxyConfig

    counted = {}
    for patience in (None, 0):
        proxy = Proxy(ProxyConfig(decode=["http://127.0.0.1:9", "http://127.0.0.1:10"],
                                  batch=4, guard="idle", step_overhead=0.0, patience=patience))
        for k in range(12):  # the round reads the monotonic clock (the pool's TTL)
            assert proxy.client.on_prefilled(f"r{k}", 50, now=time.monotonic())
        proxy.dispatcher.round()
        metrics = proxy.metrics
        counted[patience] = (metrics.guard_waits._value.get(), metrics.patience._value.get(),
                             metrics.guard._value.get())
    assert counted[None] == (1, 0, 0)
    assert counted[0] == (0, 1, 1)


@pytest.mark.timeout(90)
def test_the_guard_idle_and_patience_zero_complete_every_request(launcher: Launcher):
    """Live: two ranks of four slots, ``--guard idle --step-overhead 0``, twelve prompts at
    once: every request completes, with no bound and with ``--patience 0``; with patience 0
    no rank is ever held back, and without a bound no admission is patience's (how many
    ranks ``idle`` holds back here depends on how the arrivals fall into rounds: the counts
    themselves are checked in process, above)."""
    emulator = launcher.emulator(workers=2, batch=4, time_scale=1.0)
    counted = {}
    for patience in (None, "0"):
        extra = ("--guard", "idle", "--step-overhead", "0", "--pool-ttl", "30")
        if patience is not None:
            extra += ("--patience", patience)
        proxy = launcher.proxy(rank_urls(emulator, 2), policy="br0", batch=4, extra=extra)
        assert asyncio.run(_run(proxy.url, 12, 20)) == [20] * 12
        assert_quiescent(proxy)
        metrics = scrape(proxy)
        counted[patience] = (metrics["balanceroute_proxy_guard_waits_total{}"],
                             metrics["balanceroute_proxy_guard_patience_admissions_total{}"])
        proxy.stop()
    assert counted[None][1] == 0
    assert counted["0"][0] == 0


def test_bench_serve_rate_takes_inf_all_at_once_but_not_nan():
    import argparse
    import math

    from proxy.cli import _rate

    assert _rate("inf") == math.inf and _rate("2.5") == 2.5
    for bad in ("nan", "0", "-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            _rate(bad)


def test_an_unexpected_error_while_routing_frees_the_request_and_is_a_503(monkeypatch):
    """A bug of ours between admission and the upstream answer (here: ``start`` raising)
    must not leave the request in the pool or on a rank: the proxy closes it and answers 503."""
    from starlette.testclient import TestClient

    from proxy.app import Proxy, ProxyConfig, build_app

    closed = []
    real_close = Proxy.close

    async def failing_start(self, call, body, path):
        raise RuntimeError("boom")

    async def close(self, call):
        closed.append(call.base_id)
        await real_close(self, call)

    monkeypatch.setattr(Proxy, "start", failing_start)
    monkeypatch.setattr(Proxy, "close", close)
    with TestClient(build_app(ProxyConfig(decode=["http://127.0.0.1:9"]))) as client:
        answer = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert answer.status_code == 503
        assert answer.json()["error"]["message"] == "proxy error; retry later"
        assert len(closed) == 1
        state = client.get("/proxy/state").json()
        assert state["pool"] == state["pending"] == 0 and sum(state["per_rank"]) == 0


def test_proxy_options_wrong_together_are_an_error_not_a_traceback(capsys):
    from predictor.asgi import BODY_BUDGET, body_budget
    from predictor.cli import main
    from predictor.settings import Settings
    from proxy.app import ProxyConfig

    assert main(["proxy", "--decode", "http://127.0.0.1:9", "--max-body-bytes", "4096",
                 "--max-inflight-body-bytes", "2048"]) == 2
    assert "--max-inflight-body-bytes must be a whole number >= --max-body-bytes" in \
        capsys.readouterr().err
    assert main(["proxy", "--decode", "http://127.0.0.1:9", "--policy", "brh"]) == 2
    assert "--policy brh needs --predictor-url" in capsys.readouterr().err
    assert main(["proxy", "--decode", "http://127.0.0.1:9", "--policy", "brh",
                 "--lengths-from", "max-tokens", "--predictor-url", "http://127.0.0.1:9"]) == 2
    assert "--lengths-from max-tokens takes no --predictor-url" in capsys.readouterr().err
    assert main(["proxy", "--decode", "http://127.0.0.1:9", "--lengths-from", "max-tokens"]) == 2
    assert "--lengths-from max-tokens is for --policy brh" in capsys.readouterr().err
    # a body limit past the budget's default raises the default with it (it used to refuse)
    config = ProxyConfig(decode=["http://127.0.0.1:9"], max_body_bytes=1 << 30)
    assert body_budget(config.max_inflight_body_bytes, config.max_body_bytes) == 1 << 30
    assert body_budget(None, 1024) == BODY_BUDGET and body_budget(4096, 1024) == 4096
    assert body_budget(Settings(max_body_bytes=1 << 30).max_inflight_body_bytes,
                       1 << 30) == 1 << 30


def test_the_proxys_body_bounds_answer_openai_style_naming_the_option():
    """The 413 through the proxy's app, counted in its metrics, and how the proxy words the
    budget's 503 and the 408 (both exercised live in test_proxy_e2e.py and in
    tests/predictor/test_asgi.py)."""
    from starlette.testclient import TestClient

    from proxy.app import ProxyConfig, _body_error, build_app

    config = ProxyConfig(decode=["http://127.0.0.1:9"], max_body_bytes=1024,
                         max_inflight_body_bytes=4096)
    with TestClient(build_app(config)) as client:
        answer = client.post("/v1/completions", content=b"x" * 2000)
        assert answer.status_code == 413
        assert answer.json()["error"]["message"] == \
            "request body over the limit of 1024 bytes (--max-body-bytes)"
        assert client.post("/v1/completions", content=b"{not json").status_code == 400
        # both counted as invalid input (the 413 answered before the proxy's handler ran,
        # once not counted at all, nor the 400)
        assert 'balanceroute_proxy_requests_total{outcome="invalid"} 2.0' in \
            client.get("/metrics").text
    busy = _body_error(503, "the server holds 4096 bytes")
    assert busy["error"]["type"] == "server_busy"
    assert busy["error"]["message"].endswith("(--max-inflight-body-bytes)")
    assert _body_error(408, "request body not received whole")["error"] == {
        "message": "request body not received whole", "type": "timeout", "code": 408}


@pytest.mark.timeout(90)
def test_two_phase_requests_through_a_prefill_instance_keep_min_tokens_to_the_rank(
        launcher: Launcher):
    """With ``--prefill`` the proxy asks the prefill instance first with ``max_tokens`` 1. It
    used to copy ``min_tokens`` into that probe, which an engine (vLLM; the emulator checks
    the same) refuses when above 1: the request failed. Now the probe drops it, the decode
    rank gets the request as sent, and the usage is the engine's."""
    emulator = launcher.emulator(workers=2, batch=2, time_scale=20.0,
                                 extra=("--prefill-workers", "1"))
    ranks = rank_urls(emulator, 3)
    proxy = launcher.proxy(ranks[:2], batch=2, extra=("--prefill", ranks[2]))
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0,
                           timeout=30.0)
    answer = client.completions.create(model="m", prompt="word " * 40, max_tokens=6,
                                       extra_body={"min_tokens": 4, "ignore_eos": True})
    assert answer.usage.completion_tokens == 6
    with httpx.Client(timeout=10.0) as http:  # the emulator refuses what vLLM refuses
        refused = http.post(ranks[0] + "/v1/completions",
                            json={"prompt": "x", "max_tokens": 1, "min_tokens": 4})
    assert refused.status_code == 400
    assert "min_tokens must be less than or equal to max_tokens=1" in refused.text
    assert_quiescent(proxy)


def _occupy(url: str, max_tokens: int = 5000) -> tuple[httpx.Client, httpx.Response, Any]:
    """A long stream sent to a rank directly (not through the proxy), begun: the rank's one
    slot is taken behind the proxy's back. Close the client to end it; keep the chunk iterator
    until then (collected, it closes the stream)."""
    http = httpx.Client(timeout=60.0)
    stream = http.send(http.build_request("POST", url + "/v1/completions", json={
        "prompt": [3] * 50, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}),
        stream=True)
    assert stream.status_code == 200
    chunks = stream.iter_raw()
    next(chunks)  # the first token: the request runs
    return http, stream, chunks


@pytest.mark.timeout(90)
def test_a_busy_rank_is_held_back_and_the_request_routed_again(launcher: Launcher):
    """A rank that answers 503 (SGLang's bounded queue is full; the emulator's
    ``--max-queued-requests``) ran nothing: the proxy holds it back for a second (no
    Retry-After) and routes the request to another rank. When every rank refuses, the client
    gets the engine's answer and a Retry-After; nothing is left in the proxy's state."""
    full = launcher.emulator(workers=2, batch=1, extra=("--max-queued-requests", "0"))
    spare = launcher.emulator(workers=1, batch=4)
    busy = rank_urls(full, 2)
    occupied = [_occupy(url) for url in busy]  # each rank of `full` runs its one request
    try:
        # eight requests for the proxy's eight slots: four go to the busy rank 0, which
        # refuses them; each is routed again, to rank 1, as its slots free
        mixed = launcher.proxy([busy[0], spare.url], batch=4)
        assert asyncio.run(_run(mixed.url, 8, 5)) == [5] * 8
        metrics = scrape(mixed)
        assert metrics["balanceroute_proxy_engine_errors_total{kind=busy 503,rank=decode0}"] \
            >= 1
        assert metrics["balanceroute_proxy_requests_total{outcome=length}"] == 8
        # held back for a second, then routable again
        _wait_for(lambda: proxy_state(mixed)["up"] == [True, True], "the hold to end")
        assert_quiescent(mixed)

        refusing = launcher.proxy(busy, batch=4)
        with httpx.Client(timeout=30.0) as http:
            answer = http.post(refusing.url + "/v1/completions",
                               json={"prompt": "x", "max_tokens": 5})
        assert answer.status_code == 503
        assert answer.json()["message"] == "The request queue is full."  # the engine's words
        assert 1 <= int(answer.headers["retry-after"]) <= 2
        metrics = scrape(refusing)
        assert [metrics.get(f"balanceroute_proxy_engine_errors_total{{kind=busy 503,rank="
                            f"decode{g}}}") for g in (0, 1)] == [1, 1]
        assert metrics["balanceroute_proxy_requests_total{outcome=rejected}"] == 1
        assert_quiescent(refusing)
    finally:
        for http, stream, _chunks in occupied:
            stream.close()
            http.close()


def test_retry_after_reads_seconds_and_http_dates():
    from datetime import datetime, timedelta
    from email.utils import format_datetime

    from proxy.engines import retry_after_s

    assert retry_after_s("3") == 3.0
    assert retry_after_s(" 1.5 ") == 1.5
    assert retry_after_s(None) is None
    assert retry_after_s("soon") is None
    assert retry_after_s("inf") is None
    assert retry_after_s("-4") == 0.0
    now = datetime(2026, 12, 4, 12, 0, 0, tzinfo=UTC)
    date = format_datetime(now + timedelta(seconds=7), usegmt=True)
    assert retry_after_s(date, now=now.timestamp()) == pytest.approx(7.0)
    assert retry_after_s(format_datetime(now - timedelta(seconds=7), usegmt=True),
                         now=now.timestamp()) == 0.0


def test_a_busy_ranks_hold_follows_its_retry_after_within_bounds():
    """``EngineSet.hold``: the rank's Retry-After, 1 s without one, 30 s at most; a longer
    hold is kept over a shorter one; the rank is routable again when it ends."""
    from proxy.engines import HOLD_DEFAULT_S, HOLD_MAX_S, EngineSet
    from proxy.metrics import ProxyMetrics

    async def scenario():
        woken = []
        engines = EngineSet(["http://127.0.0.1:1", "http://127.0.0.1:2"], httpx.AsyncClient(),
                            ProxyMetrics(), lambda: woken.append(1))
        try:
            assert engines.hold(0, None, "busy 503") == pytest.approx(HOLD_DEFAULT_S, abs=0.05)
            assert engines.up == [False, True]
            assert engines.hold(1, 3600.0, "busy 429") == pytest.approx(HOLD_MAX_S, abs=0.05)
            assert engines.hold(1, 0.1, "busy 429") == pytest.approx(HOLD_MAX_S, abs=0.05)
            assert engines.held_for() == pytest.approx(HOLD_DEFAULT_S, abs=0.05)
            assert engines.hold(0, 0.05, "busy 503") > 0.5  # the longer hold stays
            await asyncio.sleep(HOLD_DEFAULT_S + 0.2)
            assert engines.up == [True, False] and woken == [1]
            assert engines.held_for() == pytest.approx(HOLD_MAX_S - HOLD_DEFAULT_S - 0.2,
                                                       abs=0.2)
        finally:
            engines.close()
            await engines.http.aclose()

    asyncio.run(scenario())


def test_a_clients_x_prompt_key_is_the_requests_key_and_a_bad_one_is_refused(monkeypatch):
    """The key the router (and the service's ExactMatch) groups a request by: the client's
    ``X-Prompt-Key`` when sent, else the hash of its prompt; an empty or over-long one is a
    400 naming the header."""
    from starlette.testclient import TestClient

    from proxy.app import Proxy, ProxyConfig, ProxyError, build_app
    from router_client.traces import key_of_text

    keys = []

    async def admit(self, call, tokens, key):
        keys.append(key)
        raise ProxyError(429, "the prompt pool is full", "rate_limit_error")

    monkeypatch.setattr(Proxy, "_admit", admit)
    monkeypatch.setattr("proxy.engines.EngineSet.any_alive", lambda self: True)
    body = {"prompt": "hello", "max_tokens": 2}
    with TestClient(build_app(ProxyConfig(decode=["http://127.0.0.1:9"]))) as client:
        assert client.post("/v1/completions", json=body,
                           headers={"X-Prompt-Key": "template-7"}).status_code == 429
        assert client.post("/v1/completions", json=body).status_code == 429
        for bad in ("", "k" * 257):
            answer = client.post("/v1/completions", json=body, headers={"X-Prompt-Key": bad})
            assert answer.status_code == 400
            assert "X-Prompt-Key header must be 1 to 256 characters" in \
                answer.json()["error"]["message"]
    assert keys == ["template-7", key_of_text('"hello"')]


def _waiting_request(proxy_url: str) -> tuple[Any, list]:
    """A request sent now (it waits in the pool); the second item fills with (seconds it
    took, the response) when it ends."""
    import threading

    out: list = []

    def send() -> None:
        began = time.monotonic()
        response = httpx.post(proxy_url + "/v1/completions", timeout=90.0, json={
            "model": "m", "prompt": [3] * 20, "max_tokens": 3, "ignore_eos": True})
        out.append((time.monotonic() - began, response))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, out


async def _one_running_one_waiting(proxy) -> tuple[asyncio.Future, tuple[Any, list]]:
    """On a proxy of one slot: a long stream holding the slot, and a request waiting in the
    pool behind it."""
    streaming = [0]
    holder = asyncio.ensure_future(_run(proxy.url, 1, 100_000, streaming))
    await asyncio.to_thread(_wait_for, lambda: streaming[0] == 1, "the slot's holder")
    waiting = _waiting_request(proxy.url)
    await asyncio.to_thread(_wait_for, lambda: proxy_state(proxy)["pool"] == 1,
                            "a request waiting")
    return holder, waiting


@pytest.mark.timeout(90)
def test_with_every_rank_down_waiting_requests_get_a_503_after_the_grace(launcher: Launcher):
    """A request waiting in the pool when the last rank goes down gets the 503 a new request
    gets at once, after ``--down-grace`` (1 s here), not the 60 s pool TTL; a rank that comes
    back within the grace takes its waiting requests."""
    doomed = launcher.emulator(workers=1, batch=1, time_scale=1.0)
    proxy = launcher.proxy([doomed.url], policy="br0", batch=1,
                           extra=("--down-grace", "1", "--pool-ttl", "60"))
    first = _waiting_request(proxy.url)  # the rank works
    first[0].join(timeout=30)
    assert first[1] and first[1][0][1].status_code == 200

    async def hold_and_kill() -> tuple[str | int, list]:
        holder, waiting = await _one_running_one_waiting(proxy)
        doomed.kill()
        await asyncio.to_thread(waiting[0].join, 60)
        return (await holder)[0], waiting[1]

    held, waited = asyncio.run(hold_and_kill())
    assert isinstance(held, str)  # the holder's stream was cut with its rank
    seconds, response = waited[0]
    assert response.status_code == 503 and response.json()["error"]["message"] == \
        "no decode rank is up"
    assert response.headers["retry-after"] == "1"
    assert seconds < 30  # the grace and a probe or two, not the 60 s pool TTL
    assert_quiescent(proxy)


@pytest.mark.timeout(90)
def test_a_rank_back_within_the_grace_takes_the_waiting_requests(launcher: Launcher):
    rank = launcher.emulator(workers=1, batch=1, time_scale=1.0)
    port = int(rank.url.rsplit(":", 1)[1])
    proxy = launcher.proxy([rank.url], policy="br0", batch=1,
                           extra=("--down-grace", "60", "--pool-ttl", "60"))

    async def restart() -> list:
        holder, waiting = await _one_running_one_waiting(proxy)
        rank.kill()
        await holder
        await asyncio.to_thread(_wait_for, lambda: proxy_state(proxy)["up"] == [False],
                                "the rank marked down")
        launcher.emulator(workers=1, batch=1, port=port)  # back, within the grace
        await asyncio.to_thread(waiting[0].join, 60)
        return waiting[1]

    waited = asyncio.run(restart())
    assert waited and waited[0][1].status_code == 200
    assert len(waited[0][1].json()["choices"][0]["text"]) > 0
    assert_quiescent(proxy)


def test_a_proxy_port_taken_is_one_clear_error_before_it_says_where_it_listens(capsys):
    from predictor.cli import main

    with _taken_port() as port:
        assert main(["proxy", "--decode", "http://127.0.0.1:9", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"balanceroute proxy: error: cannot listen on 127.0.0.1:{port}" in err
    assert "balanceroute proxy on http" not in err


@pytest.mark.timeout(60)
def test_start_after_holds_the_first_round_until_the_first_wave_is_in(launcher: Launcher):
    """With --start-after 3 the proxy routes nothing while two requests wait, then the whole
    wave once the third comes; later requests are routed at once."""
    emulator = launcher.emulator(workers=2, batch=4, time_scale=1.0)
    proxy = launcher.proxy(rank_urls(emulator, 2), extra=("--start-after", "3"))

    async def wave() -> list[str | int]:
        first = asyncio.ensure_future(_run(proxy.url, 2, 4))
        await asyncio.to_thread(_wait_for, lambda: proxy_state(proxy)["pool"] == 2,
                                "two requests in the pool")
        await asyncio.sleep(0.5)  # rounds would have run by now (every 10 ms while waiting)
        held = proxy_state(proxy)
        assert held["pool"] == 2 and held["active"] == 0, held
        return [*await _run(proxy.url, 1, 4), *await first]

    assert asyncio.run(wave()) == [4, 4, 4]
    assert asyncio.run(_run(proxy.url, 1, 4)) == [4]  # after the start, no wait
    assert_quiescent(proxy)
