"""BR-0 through the proxy beats jsq and rr on the emulator's own step log (small, saturated).

G = 4 ranks of B = 4 slots, a load-dominated step cost (4 us per KV token + 2 ms), heavy-tailed
prompts, and a closed loop that keeps 4 requests per rank waiting in the pool (the backlog
regime of ``balanceroute ab --load backlog``). Throughput is in emulated time (the cost model's
step durations), so a busy machine slows the run but does not change the figures much.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.emulator import summarize
from proxy.loadgen import LoadConfig, run
from router_client.traces import Trace

from .conftest import Launcher, assert_quiescent, rank_urls

G, B, N = 4, 4, 60


def workload() -> Trace:
    rng = np.random.default_rng(0)
    prompts = np.clip(rng.lognormal(np.log(1500), 0.9, N), 50, 12000).astype(np.int64)
    outputs = rng.integers(10, 90, N).astype(np.int64)
    return Trace("heavy-tailed", prompts, outputs, np.zeros(N, dtype=bool), [None] * N, None)


def measure(launcher: Launcher, emulator, policy: str) -> dict:
    proxy = launcher.proxy(rank_urls(emulator, G), policy=policy, batch=B)
    since = httpx.get(emulator.url + "/emulator/steps").json()["next"]
    summary, _ = asyncio.run(run(workload(), LoadConfig(
        url=proxy.url, rate=float("inf"), max_concurrency=G * B + 4 * G)))
    assert summary["failed"] == 0, summary["errors"]
    assert_quiescent(proxy)
    # the choice each round had: the closed loop keeps up to 4 per rank waiting
    pool = {s.name: s.value for family in text_string_to_metric_families(
        httpx.get(proxy.url + "/metrics").text) for s in family.samples
        if s.name.startswith("balanceroute_proxy_round_pool_requests")}
    rounds = pool["balanceroute_proxy_round_pool_requests_count"]
    assert rounds > 0
    assert 1 <= pool["balanceroute_proxy_round_pool_requests_sum"] / rounds <= 4 * G
    proxy.stop()
    steps = httpx.get(emulator.url + f"/emulator/steps?since={since}").json()["steps"]
    # the routing window: until 80% of the tokens (the drain after it has nothing to route)
    tokens = np.cumsum([step["tokens"] for step in steps])
    return summarize(steps[: int(np.searchsorted(tokens, 0.8 * tokens[-1]))], 4e-6)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_br0_beats_jsq_and_rr_through_the_proxy(launcher: Launcher):
    emulator = launcher.emulator(workers=G, batch=B, time_scale=1.0, step_cost="4e-6,0.002")
    results = {policy: measure(launcher, emulator, policy) for policy in ("br0", "jsq", "rr")}
    for baseline in ("jsq", "rr"):
        assert results["br0"]["tok_s"] > results[baseline]["tok_s"], results
        assert (results["br0"]["imbalance_maxmin_mean"]
                < results[baseline]["imbalance_maxmin_mean"]), results
