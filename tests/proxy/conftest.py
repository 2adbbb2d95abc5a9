"""Real processes on 127.0.0.1: emulators and proxies started with the CLI, stopped by pid."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from predictor.livesrv import wait_ready

START_TIMEOUT_S = 30.0


def scrape(proxy: Process) -> dict[str, float]:
    """``name{label=value,...}`` -> value, from the proxy's /metrics."""
    out: dict[str, float] = {}
    text = httpx.get(proxy.url + "/metrics", timeout=5.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def poll_until(predicate, what: str, timeout_s: float, interval_s: float):
    """``predicate()``'s first truthy value, asked every ``interval_s``; fails the test after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)


def _port_window() -> tuple[int, int]:
    """Ports to pick from: below the kernel's ephemeral range, which every outgoing
    connection (hundreds in the scale test) draws from, so a port found free here is not
    taken by a client socket before the process under test binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return (10000, low) if low > 12000 else (20000, 60000)


def free_ports(count: int) -> int:
    """A base port with ``count`` consecutive free ports after it."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    lo, hi = _port_window()
    for _ in range(200):
        base = rng.randrange(lo, hi - count)
        sockets = []
        try:
            for offset in range(count):
                sock = socket.socket()
                sockets.append(sock)  # closed below even when its bind fails
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free port range")


@dataclass
class Process:
    args: list[str]
    url: str
    log: str
    popen: subprocess.Popen | None = None

    def start(self, ready_path: str, timeout_s: float = START_TIMEOUT_S) -> Process:
        with open(self.log, "ab") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "predictor.cli", *self.args],
                stdout=subprocess.DEVNULL, stderr=log)
        state = wait_ready(self.popen, self.url + ready_path, timeout_s)
        if state == "exited":
            raise RuntimeError(f"{self.args[0]} exited: {self.log_tail()}")
        if state == "timeout":
            raise RuntimeError(f"{self.args[0]} did not start: {self.log_tail()}")
        return self

    def log_tail(self) -> str:
        with open(self.log) as f:
            return f.read()[-2000:]

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


@dataclass
class Launcher:
    tmp: str
    started: list[Process] = field(default_factory=list)

    def emulator(self, workers: int, batch: int = 8, time_scale: float = 1.0,
                 step_cost: str = "1e-6,0.002", port: int | None = None,
                 extra: tuple[str, ...] = ()) -> Process:
        def make(base: int) -> Process:
            return Process(["emulate", "--workers", str(workers), "--port", str(base),
                            "--batch", str(batch), "--time-scale", str(time_scale),
                            "--step-cost", step_cost, *extra],
                           f"http://127.0.0.1:{base}", f"{self.tmp}/emulator-{base}.log")
        return self._start(make, workers, port, "/health")

    def proxy(self, decode: list[str], policy: str = "br0", batch: int = 8,
              extra: tuple[str, ...] = ()) -> Process:
        def make(port: int) -> Process:
            return Process(["proxy", "--decode", ",".join(decode), "--port", str(port),
                            "--policy", policy, "--batch", str(batch), *extra],
                           f"http://127.0.0.1:{port}", f"{self.tmp}/proxy-{port}.log")
        return self._start(make, 1, None, "/healthz")

    def _start(self, make, count: int, port: int | None, ready_path: str) -> Process:
        """Start on free ports; if another process took one between the check and the bind
        (seen once in CI), try other ports, at most three times. A given ``port`` is tried
        once."""
        for attempt in range(1 if port is not None else 3):
            process = make(port if port is not None else free_ports(count))
            self.started.append(process)
            try:
                return process.start(ready_path)
            except RuntimeError:
                if port is not None or attempt == 2 or \
                        "Address already in use" not in process.log_tail():
                    raise
        raise AssertionError("unreachable")

    def stop_all(self) -> None:
        for process in self.started:
            process.stop()


@pytest.fixture
def launcher(tmp_path) -> Iterator[Launcher]:
    launch = Launcher(str(tmp_path))
    try:
        yield launch
    finally:
        launch.stop_all()


def rank_urls(emulator: Process, workers: int) -> list[str]:
    base = int(emulator.url.rsplit(":", 1)[1])
    return [f"http://127.0.0.1:{base + g}" for g in range(workers)]


def proxy_state(proxy: Process) -> dict:
    return httpx.get(proxy.url + "/proxy/state", timeout=5.0).json()


def assert_quiescent(proxy: Process, timeout_s: float = 10.0) -> dict:
    """Mirrored-state invariants hold and, once traffic stops, every slot is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = proxy_state(proxy)
        assert state["invariants"] == "ok", state
        if state["active"] == 0 and state["pool"] == 0 and state["pending"] == 0:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"slots still taken after {timeout_s}s: {state}")
        time.sleep(0.1)
