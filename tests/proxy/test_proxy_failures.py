"""A decode rank killed mid-run fails only its own in-flight requests; routing continues."""

from __future__ import annotations

import asyncio

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
    healthy = launcher.emulator(workers=2, batch=8, time_scale=1.0)
    dead = free_ports(3)  # nothing listens there
    urls = [f"http://127.0.0.1:{dead + g}" for g in range(3)] + rank_urls(healthy, 2)
    proxy = launcher.proxy(urls, policy="br0", batch=8)
    # one request alone meets the dead ranks one after another (ties go to the lowest rank)
    assert asyncio.run(_run(proxy.url, 1, 5)) == [5]
    assert asyncio.run(_run(proxy.url, 16, 5)) == [5] * 16
    state = assert_quiescent(proxy)
    assert state["up"] == [False, False, False, True, True]


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


def _counter(proxy, name: str) -> float:
    for line in httpx.get(proxy.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not exported")


@pytest.mark.timeout(90)
def test_the_guard_idle_holds_ranks_back_and_patience_zero_never_does(launcher: Launcher):
    """Two ranks of four slots (8 > ``s_greedy`` 7, so the guard ``idle`` acts), no fixed step
    cost to weigh (``--step-overhead 0``) and twelve equal 50-token prompts at once: a rank
    at the maximum load scores every prompt F = 50 - 2 * 50 < 0, and ``idle`` leaves its
    slots empty while the other rank takes what fits, so ``/metrics`` counts ranks held back;
    every request still completes. With ``--patience 0`` the same proxy never holds a rank
    back (the guard ``always``): where it would have, patience forces the admission, and
    ``/metrics`` counts that."""
    emulator = launcher.emulator(workers=2, batch=4, time_scale=1.0)
    waits, forced = {}, {}
    for patience in (None, "0"):
        extra = ("--guard", "idle", "--step-overhead", "0", "--pool-ttl", "30")
        if patience is not None:
            extra += ("--patience", patience)
        proxy = launcher.proxy(rank_urls(emulator, 2), policy="br0", batch=4, extra=extra)
        assert asyncio.run(_run(proxy.url, 12, 20)) == [20] * 12
        assert_quiescent(proxy)
        waits[patience] = _counter(proxy, "balanceroute_proxy_guard_waits_total")
        forced[patience] = _counter(proxy, "balanceroute_proxy_guard_patience_admissions_total")
        proxy.stop()
    assert waits[None] > 0 and forced[None] == 0
    assert waits["0"] == 0 and forced["0"] > 0
