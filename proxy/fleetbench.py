"""``balanceroute bench proxy-ab``: routing policies compared through real HTTP, and against
``balanceroute ab`` on the same trace.

For each policy a fresh emulator (``balanceroute emulate``, G ranks of B slots) and a fresh proxy
(``balanceroute proxy --policy P``) run as subprocesses on 127.0.0.1; the load generator
(:mod:`proxy.loadgen`) replays the trace through the proxy with ``max_tokens`` and
``ignore_eos`` from the trace, in a closed loop of ``G * B + 4 * G`` requests in flight: the
ranks kept full and ``4 * G`` requests waiting in the proxy's pool, in trace order, which is
``ab --load backlog``. Throughput and imbalance are read from the emulator's own step log
(emulated time: the step-cost model, not the wall clock, so a loaded machine slows the run
but does not change the figures), over the steps up to the last admission, as ``ab`` counts
them. Then ``ab`` replays the same requests in the simulator, and each policy's ratio to BR-0
is compared between the two.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from router_client.traces import Trace

from .loadgen import LoadConfig, run

BACKLOG_PER_RANK = 4


@dataclass(frozen=True)
class FleetBenchConfig:
    workers: int = 8
    batch: int = 16
    step_cost: tuple[float, float] = (1.5e-7, 0.010)
    time_scale: float = 0.25
    seed: int = 0


def _free_base(count: int) -> int:
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + count >= 65000:
            continue
        try:
            held = []
            for offset in range(count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no free range of ports")


@contextmanager
def spawned(args: list[str], ready_url: str, log_path: str,
            timeout_s: float = 120.0) -> Iterator[subprocess.Popen]:
    """``balanceroute ARGS`` as a subprocess, ready when ``ready_url`` answers 200."""
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "predictor.cli", *args],
                                   stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{args[0]} exited; see {log_path}")
            try:
                if httpx.get(ready_url, timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{args[0]} did not start; see {log_path}")
            time.sleep(0.2)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def step_log_summary(steps: list[dict[str, Any]]) -> dict[str, float]:
    """``ab``'s figures from the emulator's step log: steps up to the last admission."""
    last = max((i for i, s in enumerate(steps) if s.get("admitted")), default=-1)
    window = [s for s in steps[: last + 1] if any(s["active"])]
    if not window:
        return {"steps": 0, "tokens": 0, "emulated_s": 0.0, "throughput_tok_s": 0.0,
                "imbalance_maxmin_mean": 0.0, "imbalance_total_mean": 0.0}
    loads = np.asarray([s["loads"] for s in window], dtype=np.float64)
    top = loads.max(axis=1)
    tokens = int(sum(s["tokens"] for s in window))
    emulated = float(sum(s["dt"] for s in window))
    return {
        "steps": len(window), "tokens": tokens, "emulated_s": emulated,
        "throughput_tok_s": tokens / emulated if emulated else 0.0,
        "imbalance_maxmin_mean": float((top - loads.min(axis=1)).mean()),
        "imbalance_total_mean": float((loads.shape[1] * top - loads.sum(axis=1)).mean()),
    }


def run_policy(trace: Trace, policy: str, config: FleetBenchConfig, workdir: str,
               ) -> dict[str, Any]:
    """One policy through real HTTP: emulator and proxy started for it, trace replayed."""
    G, B = config.workers, config.batch
    base = _free_base(G)
    a, b = config.step_cost
    emulate = ["emulate", "--workers", str(G), "--port", str(base), "--batch", str(B),
               "--step-cost", f"{a!r},{b!r}", "--time-scale", str(config.time_scale),
               "--seed", str(config.seed)]
    ranks = ",".join(f"http://127.0.0.1:{base + g}" for g in range(G))
    port = _free_base(1)
    proxy = ["proxy", "--decode", ranks, "--port", str(port), "--policy", policy,
             "--batch", str(B), "--pool-ttl", "3600", "--engine-timeout", "600"]
    url = f"http://127.0.0.1:{port}"
    with spawned(emulate, f"http://127.0.0.1:{base}/health",
                 os.path.join(workdir, f"emulate-{policy}.log")), \
            spawned(proxy, url + "/healthz", os.path.join(workdir, f"proxy-{policy}.log")):
        load = LoadConfig(url=url, rate=float("inf"),
                          max_concurrency=G * B + BACKLOG_PER_RANK * G, seed=config.seed)
        summary, _ = asyncio.run(run(trace, load))
        steps = httpx.get(f"http://127.0.0.1:{base}/emulator/steps", timeout=60.0).json()
        state = httpx.get(url + "/proxy/state", timeout=10.0).json()
    row = {"policy": policy, **step_log_summary(steps["steps"]),
           "completed": summary["completed"], "failed": summary["failed"],
           "wall_s": summary["duration_s"], "wall_tok_s": summary["output_throughput"],
           "invariants": state["invariants"]}
    return row


def simulate(trace: Trace, policies: list[str], config: FleetBenchConfig) -> dict[str, dict]:
    """``balanceroute ab --load backlog`` on the same requests and fleet."""
    from predictor.abtest import run_comparison
    from router_client.simulator import SimConfig

    sim = SimConfig(batch=config.batch, load="backlog", step_cost=config.step_cost,
                    seed=config.seed)
    rows = run_comparison(trace, policies, [config.workers], sim).rows
    return {row["policy"]: row for row in rows}


def compare(trace: Trace, policies: list[str], config: FleetBenchConfig,
            progress: bool = True) -> list[dict[str, Any]]:
    """Rows per policy: through the proxy, in the simulator, and the ratios' agreement."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="proxy-ab-") as workdir:
        for policy in policies:
            started = time.monotonic()
            rows.append(run_policy(trace, policy, config, workdir))
            if progress:
                print(f"{policy}: {time.monotonic() - started:.0f} s wall", file=sys.stderr)
    sim = simulate(trace, policies, config)
    reference = next((r for r in rows if r["policy"] == "br0"), rows[0])
    sim_reference = sim[reference["policy"]]
    for row in rows:
        ab = sim[row["policy"]]
        row["ab_throughput_tok_s"] = ab["throughput_tok_s"]
        row["ab_imbalance_maxmin_mean"] = ab["imbalance_maxmin_mean"]
        row["ratio"] = row["throughput_tok_s"] / reference["throughput_tok_s"]
        row["ab_ratio"] = ab["throughput_tok_s"] / sim_reference["throughput_tok_s"]
        row["agreement"] = row["ratio"] / row["ab_ratio"] - 1.0
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'policy':<7} {'proxy tok/s':>11} {'x br0':>7} {'max-min':>8} "
             f"{'ab tok/s':>9} {'x br0':>7} {'max-min':>8} {'ratio vs ab':>11} "
             f"{'failed':>6} {'wall s':>6}"]
    for r in rows:
        lines.append(
            f"{r['policy']:<7} {r['throughput_tok_s']:11.0f} {r['ratio']:7.4f} "
            f"{r['imbalance_maxmin_mean']:8.0f} {r['ab_throughput_tok_s']:9.0f} "
            f"{r['ab_ratio']:7.4f} {r['ab_imbalance_maxmin_mean']:8.0f} "
            f"{100 * r['agreement']:+10.2f}% {r['failed']:6d} {r['wall_s']:6.0f}")
    return "\n".join(lines)
