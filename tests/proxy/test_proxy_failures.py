"""A decode rank killed mid-run fails only its own in-flight requests; routing continues."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from .conftest import Launcher, assert_quiescent, poll_until, proxy_state, rank_urls


async def _run(proxy_url: str, n: int, max_tokens: int) -> list[str | int]:
    client = openai.AsyncOpenAI(base_url=proxy_url + "/v1", api_key="x", max_retries=0,
                                timeout=60.0)

    async def one() -> str | int:
        try:
            stream = await client.completions.create(
                model="m", prompt=[3] * 50, max_tokens=max_tokens, stream=True,
                extra_body={"ignore_eos": True})
            return sum([1 async for c in stream if c.choices and c.choices[0].text])
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
        task = asyncio.ensure_future(_run(proxy.url, n, max_tokens))
        def dispatched():
            per_rank = proxy_state(proxy)["per_rank"]
            return per_rank if sum(per_rank) == n else None

        per_rank = await asyncio.to_thread(_wait_for, dispatched, "all requests dispatched")
        doomed.kill()
        return per_rank, await task

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
