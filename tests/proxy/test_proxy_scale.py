"""500 concurrent streams through one proxy process, with the official openai client."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from .conftest import Launcher, assert_quiescent, rank_urls

G, B = 8, 64
STREAMS = 500
OUTPUT = 120


async def _streams(proxy_url: str, seen: list[dict]) -> list[tuple[int, int, str | None]]:
    """STREAMS streaming completions at once; (deltas, usage tokens, error) for each, while
    the proxy's mirrored state is sampled into ``seen``."""
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=STREAMS),
                             timeout=httpx.Timeout(300.0, connect=60.0))
    client = openai.AsyncOpenAI(base_url=proxy_url + "/v1", api_key="x", max_retries=0,
                                http_client=http)

    async def one(i: int) -> tuple[int, int, str | None]:
        try:
            stream = await client.completions.create(
                model="m", prompt=[7] * (20 + i % 50), max_tokens=OUTPUT, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            deltas, usage = 0, 0
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    deltas += 1
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            return deltas, usage, None
        except openai.APIError as exc:
            return 0, 0, f"{type(exc).__name__}: {exc}"

    async def sample(done: asyncio.Event) -> None:
        while not done.is_set():
            seen.append((await http.get(proxy_url + "/proxy/state")).json())
            await asyncio.sleep(0.2)

    done = asyncio.Event()
    sampler = asyncio.ensure_future(sample(done))
    try:
        return await asyncio.gather(*(one(i) for i in range(STREAMS)))
    finally:
        done.set()
        await sampler
        await client.close()


@pytest.mark.timeout(280)
def test_500_concurrent_streams_on_one_proxy(launcher: Launcher):
    # Steps of 40 ms (model time): each stream lasts at least OUTPUT steps, long enough for all
    # 500 to be open at once; 8 x 64 = 512 slots, so none waits in the pool for long.
    emulator = launcher.emulator(workers=G, batch=B, step_cost="1e-9,0.04")
    proxy = launcher.proxy(rank_urls(emulator, G), policy="br0", batch=B)
    seen: list[dict] = []
    started = time.monotonic()
    results = asyncio.run(_streams(proxy.url, seen))
    errors = [error for _, _, error in results if error]
    assert not errors, errors[:5]
    assert all(deltas == OUTPUT and usage == OUTPUT for deltas, usage, _ in results)
    # sound throughout: sampled while the streams ran, never a rank above B
    assert seen and all(s["invariants"] == "ok" for s in seen)
    assert all(max(s["per_rank"]) <= B for s in seen)
    peak = max(s["active"] + s["pool"] for s in seen)
    elapsed = time.monotonic() - started
    assert peak >= 0.9 * STREAMS, f"only {peak} streams open at once ({elapsed:.0f} s)"
    state = assert_quiescent(proxy, timeout_s=30.0)
    assert state["counters"]["finished"] == STREAMS and state["counters"]["cancelled"] == 0
    stats = httpx.get(emulator.url + "/emulator/stats", timeout=10.0).json()
    assert sum(r["finished"] for r in stats["ranks"]) == STREAMS
    assert all(r["active"] == 0 and r["waiting"] == 0 for r in stats["ranks"])
    assert max(max(s["active"]) for s in httpx.get(
        emulator.url + "/emulator/steps", timeout=10.0).json()["steps"]) <= B
