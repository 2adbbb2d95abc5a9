"""The prediction service killed mid-run: the proxy routes as BR-0, and BR-H again after it
restarts (real ``balanceroute serve`` on SQLite, emulator and proxy; openai client traffic)."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from .conftest import (
    Launcher,
    Process,
    assert_quiescent,
    free_ports,
    poll_until,
    rank_urls,
    scrape,
)

G, B = 4, 8


def wait_for(predicate, what: str, timeout_s: float = 60.0) -> dict[str, float]:
    return poll_until(predicate, what, timeout_s, interval_s=0.2)


class Traffic:
    """Keeps ``workers`` streaming completions going until stopped (a thread of its own)."""

    def __init__(self, url: str, workers: int = 6) -> None:
        self.url, self.workers = url, workers
        self.stop = threading.Event()
        self.done: list[int] = []
        self.errors: list[str] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0,
                                    timeout=60.0)

        async def worker(w: int) -> None:
            i = 0
            while not self.stop.is_set():
                i += 1
                try:
                    stream = await client.completions.create(
                        model="m", prompt=[w + 1] * (30 + 17 * (i % 5)),
                        max_tokens=10 + 7 * ((w + i) % 4), stream=True,
                        extra_body={"ignore_eos": True})
                    self.done.append(sum([1 async for c in stream
                                          if c.choices and c.choices[0].text]))
                except openai.APIError as exc:
                    self.errors.append(str(exc))

        try:
            await asyncio.gather(*(worker(w) for w in range(self.workers)))
        finally:
            await client.close()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def _brh_active(proxy: Process, want: float):
    def check() -> dict[str, float] | None:
        metrics = scrape(proxy)
        return metrics if metrics.get("balanceroute_router_brh_active{}") == want else None
    return check


def _gamma_set(proxy: Process):
    def check():
        gamma = scrape(proxy).get("balanceroute_proxy_brh_gamma{}", 0.0)
        return gamma if gamma > 0 else None
    return check


def _switches(metrics: dict[str, float], to: str) -> float:
    return sum(v for k, v in metrics.items()
               if k.startswith("balanceroute_router_fallback_switches_total{") and f"to={to}" in k)


@pytest.mark.timeout(240)
def test_service_killed_mid_run_falls_back_to_br0_and_returns(launcher: Launcher, tmp_path):
    port = free_ports(1)
    database = f"sqlite:///{tmp_path / 'service.db'}"

    def start_service() -> Process:
        service = Process(["serve", "--host", "127.0.0.1", "--port", str(port),
                           "--database-url", database], f"http://127.0.0.1:{port}",
                          str(tmp_path / "service.log"))
        launcher.started.append(service)
        return service.start("/readyz", timeout_s=120.0)  # imports and a model fit: slow

    service = start_service()
    emulator = launcher.emulator(workers=G, batch=B, step_cost="1e-6,0.01")
    proxy = launcher.proxy(rank_urls(emulator, G), policy="brh", batch=B,
                           extra=("--predictor-url", service.url))
    traffic = Traffic(proxy.url)
    try:
        # BR-H with live predictions
        started = wait_for(lambda: traffic.done and _brh_active(proxy, 1.0)(),
                           "BR-H with predictions")
        # waiting for the service's first answer at start is no fallback and no failure
        assert _switches(started, "br0") == 0
        assert not any(k.startswith("balanceroute_router_refresh_failures_total{")
                       for k in started)
        # the default discount follows the fleet's turnover: a real discount, 0.5 <= gamma < 1
        assert 0.5 <= wait_for(_gamma_set(proxy), "a BR-H round's discount") < 1.0
        service.kill()
        down = wait_for(_brh_active(proxy, 0.0), "the switch to BR-0")
        assert _switches(down, "br0") >= 1
        rounds = down["balanceroute_proxy_fallback_rounds_total{}"]
        served = len(traffic.done)
        # still routing (as BR-0) while the service is gone
        wait_for(lambda: len(traffic.done) >= served + 20, "requests served without it")
        later = scrape(proxy)
        assert later["balanceroute_proxy_fallback_rounds_total{}"] > rounds
        assert later["balanceroute_router_brh_active{}"] == 0.0

        start_service()  # same port, same database
        back = wait_for(_brh_active(proxy, 1.0), "the return to BR-H")
        assert _switches(back, "brh") >= 1
    finally:
        traffic.finish()
    assert not traffic.errors, traffic.errors[:5]
    assert traffic.done and all(n >= 10 for n in traffic.done)
    assert_quiescent(proxy)
