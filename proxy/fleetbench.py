"""``balanceroute bench proxy-ab``: routing policies compared through real HTTP, and against
``balanceroute ab`` on the same trace.

For each policy a fresh emulator (``balanceroute emulate``, G ranks of B slots) and a fresh proxy
(``balanceroute proxy --policy P``) run as subprocesses on 127.0.0.1; the load generator
(:mod:`proxy.loadgen`) replays the trace through the proxy with ``max_tokens`` and
``ignore_eos`` from the trace, in a closed loop of ``G * B + 4 * G`` requests in flight: the
ranks kept full and ``4 * G`` requests waiting in the proxy's pool, in trace order, which is
``ab --load backlog``. The emulator holds its first step until the first ``G * B`` requests
have reached the ranks (``emulate --start-after``), so that the fleet is full from step 0 as
in ``ab``: the load generator's first wave otherwise reaches the ranks over tens of steps (a
few hundred requests a second through the proxy on a small machine), at a speed that varies
from run to run and is the harness's, not the router's. For the same reason the proxy's first
routing round waits for the whole first wave, ``G * B + 4 * G`` requests (``proxy
--start-after``): routed as it trickles in, a few requests a round with no choice among them,
it started the fleet unbalanced (on Mooncake conversation BR-0 then ran 1-5% below ``ab``).
Throughput and imbalance are read from the emulator's own step log (emulated time: the
step-cost model, not the wall clock, so a loaded machine slows the run but does not change
the figures), over the steps up to the last admission, as ``ab`` counts them. Then ``ab``
replays the same requests in the simulator, and each policy's ratio to BR-0 is compared
between the two.

``brh`` runs the proxy's BR-H against a prediction service: the one ``predictor_url`` names,
else a fresh ``balanceroute serve`` (SQLite in the run's temporary directory) started for the
run, which learns online from what the proxy reports as requests finish, as a newly deployed
service would. Its ``ab`` counterpart is ``brh-<the service's auto estimator>``, learned in
process from the same completions. ``brh-oracle`` runs the proxy's BR-H with each request's
``max_tokens`` as its length (``--lengths-from max-tokens``; the load generator sends the
trace's output length with ``ignore_eos``, so these are true lengths), against ``ab``'s
``brh-oracle``: what the proxy's mechanics cost BR-H, predictions aside.
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
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from predictor.livesrv import live_server, stop_process, wait_ready
from router_client.simulator import bound_share
from router_client.traces import Trace

from . import POLICIES
from .emulator import summarize
from .loadgen import LoadConfig, run

BACKLOG_PER_RANK = 4
SERVICE_POLICY = "brh"  # the proxy policy that asks a prediction service
ORACLE_POLICY = "brh-oracle"  # the proxy's BR-H with max_tokens as the lengths
BENCH_POLICIES = (*POLICIES, ORACLE_POLICY)


@dataclass(frozen=True)
class FleetBenchConfig:
    workers: int = 8
    batch: int = 16
    step_cost: tuple[float, float] = (1.5e-7, 0.010)
    time_scale: float = 0.25
    seed: int = 0
    predictor_url: str | None = None  # for ``brh``; None: a fresh service per run


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
        state = wait_ready(process, ready_url, timeout_s, interval_s=0.2, request_timeout_s=2.0)
        if state == "exited":
            raise RuntimeError(f"{args[0]} exited; see {log_path}")
        if state == "timeout":
            raise RuntimeError(f"{args[0]} did not start; see {log_path}")
        yield process
    finally:
        stop_process(process, timeout_s=15.0)


def step_log_summary(steps: list[dict[str, Any]], a_cost: float) -> dict[str, float]:
    """``ab``'s figures from the emulator's step log: :func:`proxy.emulator.summarize` over the
    steps up to the last admission (``a_cost``: the step-cost model's ``a``), throughput named
    as ``ab`` names it, plus the mean count of running requests."""
    last = max((i for i, s in enumerate(steps) if s.get("admitted")), default=-1)
    window = steps[: last + 1]
    summary = summarize(window, a_cost)
    summary["throughput_tok_s"] = summary.pop("tok_s")
    running = [sum(s["active"]) for s in window if any(s["active"])]
    summary["running_mean"] = float(np.mean(running)) if running else 0.0
    return summary


def step_wall_s(trace: Trace, config: FleetBenchConfig) -> float:
    """The emulator's decode step at a full batch (mean prompt, half the mean output), in wall
    seconds: the proxy's ``--step-ms``, so that it routes once per step as ``ab`` does."""
    a, b = config.step_cost
    per_rank = config.batch * (float(np.mean(trace.prompt_tokens))
                               + float(np.mean(trace.output_tokens)) / 2)
    return (a * per_rank + b) / config.time_scale


def run_policy(trace: Trace, policy: str, config: FleetBenchConfig, workdir: str,
               extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One policy through real HTTP: emulator and proxy started for it, trace replayed."""
    if policy == ORACLE_POLICY:
        row = run_policy(trace, "brh", config, workdir, ("--lengths-from", "max-tokens", *extra))
        return {**row, "policy": ORACLE_POLICY}
    G, B = config.workers, config.batch
    base = _free_base(G)
    a, b = config.step_cost
    emulate = ["emulate", "--workers", str(G), "--port", str(base), "--batch", str(B),
               "--step-cost", f"{a!r},{b!r}", "--time-scale", str(config.time_scale),
               "--seed", str(config.seed), "--start-after", str(min(G * B, len(trace)))]
    ranks = ",".join(f"http://127.0.0.1:{base + g}" for g in range(G))
    port = _free_base(1)
    proxy = ["proxy", "--decode", ranks, "--port", str(port), "--policy", policy,
             "--batch", str(B), "--pool-ttl", "3600", "--engine-timeout", "600",
             "--step-ms", f"{1000 * step_wall_s(trace, config):.3f}",
             "--step-overhead", repr(b / a if a > 0 else float("inf")),
             "--start-after", str(min(G * B + BACKLOG_PER_RANK * G, len(trace))), *extra]
    url = f"http://127.0.0.1:{port}"
    with spawned(emulate, f"http://127.0.0.1:{base}/health",
                 os.path.join(workdir, f"emulate-{policy}.log")), \
            spawned(proxy, url + "/healthz", os.path.join(workdir, f"proxy-{policy}.log")):
        load = LoadConfig(url=url, rate=float("inf"),
                          max_concurrency=G * B + BACKLOG_PER_RANK * G, seed=config.seed)
        summary, _ = asyncio.run(run(trace, load))
        steps = httpx.get(f"http://127.0.0.1:{base}/emulator/steps", timeout=60.0).json()
        state = httpx.get(url + "/proxy/state", timeout=10.0).json()
        metrics = httpx.get(url + "/metrics", timeout=10.0).text
    router_s, rounds = _histogram_sum_count(metrics, "balanceroute_proxy_router_seconds")
    pool_sum, pool_rounds = _histogram_sum_count(metrics, "balanceroute_proxy_round_pool_requests")
    row = {"policy": policy, **step_log_summary(steps["steps"], a),
           "router_rounds": rounds, "router_ms_mean": 1000 * router_s / rounds if rounds else 0.0,
           # requests waiting as a round with a free slot starts (ab's backlog keeps 4G)
           "round_pool_mean": pool_sum / pool_rounds if pool_rounds else 0.0,
           "fallback_rounds": state["fallback_rounds"], "brh_active": state["brh_active"],
           "completed": summary["completed"], "failed": summary["failed"],
           "wall_s": summary["duration_s"], "wall_tok_s": summary["output_throughput"],
           "invariants": state["invariants"], "errors": summary["errors"]}
    return row


def ab_counterpart(policy: str) -> str:
    """The ``ab`` policy a proxy policy is compared with: itself, and for ``brh`` BR-H with the
    estimator the service answers ``auto`` queries with, learned in process."""
    if policy != SERVICE_POLICY:
        return policy  # brh-oracle included: the simulator's true lengths
    from predictor.estimators import estimator_spec
    from predictor.settings import Settings

    return estimator_spec(Settings().auto_estimator).policy


def run_with_service(trace: Trace, config: FleetBenchConfig, workdir: str) -> dict[str, Any]:
    """The proxy's BR-H asking ``config.predictor_url``, else a fresh service started for the
    run; the row adds what the service learned and answered."""
    database = os.path.join(workdir, f"service-{time.monotonic_ns()}.db")
    service = (nullcontext(config.predictor_url) if config.predictor_url
               else live_server(f"sqlite:///{database}"))
    with service as url:
        row = run_policy(trace, SERVICE_POLICY, config, workdir, ("--predictor-url", url))
        return {**row, **_service_figures(url)}


def _service_figures(url: str) -> dict[str, Any]:
    status = httpx.get(url + "/v1/status", timeout=10.0).json()
    return {"service_observations": status.get("observations"),
            "service_drifted": status.get("drifted")}


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
            if policy == SERVICE_POLICY:
                rows.append(run_with_service(trace, config, workdir))
            else:
                rows.append(run_policy(trace, policy, config, workdir))
            if progress:
                print(f"{policy}: {time.monotonic() - started:.0f} s wall", file=sys.stderr)
    reference = add_ab_figures(trace, rows, config)
    for row in rows:
        row["ratio"] = row["throughput_tok_s"] / reference["throughput_tok_s"]
        row["agreement"] = row["ratio"] / row["ab_ratio"] - 1.0
    return rows


def add_ab_figures(trace: Trace, rows: list[dict[str, Any]],
                   config: FleetBenchConfig) -> dict[str, Any]:
    """Each row's ``ab`` counterpart on the same requests and fleet (:func:`simulate`): its
    policy, tok/s, max-min and tok/s over the reference's; returns the reference row (BR-0's,
    else the first)."""
    counterparts = {row["policy"]: ab_counterpart(row["policy"]) for row in rows}
    sim = simulate(trace, list(dict.fromkeys(counterparts.values())), config)
    reference = next((r for r in rows if r["policy"] == "br0"), rows[0])
    sim_reference = sim[counterparts[reference["policy"]]]
    for row in rows:
        ab = sim[counterparts[row["policy"]]]
        row["ab_policy"] = counterparts[row["policy"]]
        row["ab_throughput_tok_s"] = ab["throughput_tok_s"]
        row["ab_imbalance_maxmin_mean"] = ab["imbalance_maxmin_mean"]
        row["ab_balanced_bound_tok_s"] = ab["balanced_bound_tok_s"]
        row["ab_bound_share"] = bound_share(ab)
        row["ab_ratio"] = ab["throughput_tok_s"] / sim_reference["throughput_tok_s"]
    return reference


def format_rows(rows: list[dict[str, Any]]) -> str:
    width = max([6, *(len(r["policy"]) for r in rows)])
    lines = [f"{'policy':<{width}} {'proxy tok/s':>11} {'x br0':>7} {'max-min':>8} "
             f"{'% bound':>7} {'pool':>5} {'ab tok/s':>9} {'x br0':>7} {'max-min':>8} "
             f"{'% bound':>7} {'ratio vs ab':>11} {'failed':>6} {'wall s':>6}"]
    for r in rows:
        lines.append(
            f"{r['policy']:<{width}} {r['throughput_tok_s']:11.0f} {r['ratio']:7.4f} "
            f"{r['imbalance_maxmin_mean']:8.0f} "
            f"{100 * bound_share(r):7.2f} "
            f"{r.get('round_pool_mean', 0.0):5.1f} "
            f"{r['ab_throughput_tok_s']:9.0f} {r['ab_ratio']:7.4f} "
            f"{r['ab_imbalance_maxmin_mean']:8.0f} "
            f"{100 * r['ab_bound_share']:7.2f} "
            f"{100 * r['agreement']:+10.2f}% {r['failed']:6d} {r['wall_s']:6.0f}")
    lines.append("% bound: throughput over the balanced bound of the same steps' work (every "
                 "step at the mean rank's load): the routing's share of perfect balance, which "
                 "tok/s alone mixes with how much KV the fleet held in the window; pool: "
                 f"requests waiting as a proxy round with a free slot started (ab keeps "
                 f"{BACKLOG_PER_RANK} per rank)")
    for r in rows:
        if r["policy"] == SERVICE_POLICY:
            lines.append(
                f"{r['policy']}: compared with ab's {r['ab_policy']}; {r['fallback_rounds']} of "
                f"{r['router_rounds']:.0f} rounds routed as BR-0 (fallback), routing "
                f"{r['router_ms_mean']:.2f} ms a round; the service learned "
                f"{r.get('service_observations')} observations (drifted: "
                f"{r.get('service_drifted')})")
    return "\n".join(lines)


def _histogram_sum_count(text: str, name: str) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_sum":
                total += sample.value
            elif sample.name == f"{name}_count":
                count += sample.value
    return total, count


def overhead(trace: Trace, rate: float, config: FleetBenchConfig) -> dict[str, Any]:
    """The same requests against one emulated rank directly, then through the proxy."""
    base = _free_base(1)
    a, b = config.step_cost
    rank = f"http://127.0.0.1:{base}"
    emulate = ["emulate", "--workers", "1", "--port", str(base), "--batch", str(config.batch),
               "--step-cost", f"{a!r},{b!r}", "--time-scale", str(config.time_scale)]
    port = _free_base(1)
    url = f"http://127.0.0.1:{port}"
    load = LoadConfig(url=rank, rate=rate, seed=config.seed)
    with tempfile.TemporaryDirectory(prefix="proxy-overhead-") as workdir, \
            spawned(emulate, rank + "/health", os.path.join(workdir, "emulate.log")):
        direct, _ = asyncio.run(run(trace, load))
        proxy = ["proxy", "--decode", rank, "--port", str(port), "--policy", "br0",
                 "--batch", str(config.batch)]
        with spawned(proxy, url + "/healthz", os.path.join(workdir, "proxy.log")):
            proxied, _ = asyncio.run(run(trace, LoadConfig(**{**load.__dict__, "url": url})))
            metrics = httpx.get(url + "/metrics", timeout=10.0).text
    router_s, rounds = _histogram_sum_count(metrics, "balanceroute_proxy_router_seconds")
    wait_s, waits = _histogram_sum_count(metrics, "balanceroute_proxy_pool_wait_seconds")
    result: dict[str, Any] = {"direct": direct, "proxy": proxied, "requests": len(trace),
                              "router_rounds": rounds, "router_s": router_s,
                              "router_ms_per_request": 1000 * router_s / max(1, len(trace)),
                              "pool_wait_ms_mean": 1000 * wait_s / waits if waits else None}
    for key in ("ttft", "e2el", "itl"):
        for q in ("p50", "p99", "mean"):
            name = f"{q}_{key}_ms"
            if direct.get(name) is not None and proxied.get(name) is not None:
                result[f"added_{name}"] = proxied[name] - direct[name]
    return result


def format_overhead(result: dict[str, Any]) -> str:
    d, p = result["direct"], result["proxy"]
    lines = [f"{'ms':<10} {'direct':>9} {'proxy':>9} {'added':>8}"]
    for key, label in (("ttft", "TTFT"), ("e2el", "E2E"), ("itl", "ITL")):
        for q in ("p50", "p99"):
            name = f"{q}_{key}_ms"
            lines.append(f"{label + ' ' + q.upper():<10} {d[name]:9.2f} {p[name]:9.2f} "
                         f"{p[name] - d[name]:+8.2f}")
    lines.append(f"router: {result['router_rounds']:.0f} rounds, "
                 f"{result['router_ms_per_request']:.3f} ms of routing per request; "
                 f"mean pool wait {result['pool_wait_ms_mean'] or 0:.2f} ms; "
                 f"failed direct {d['failed']}, through the proxy {p['failed']}")
    return "\n".join(lines)


DEMO_REQUESTS = 160


def demo_stage(trace_path: str, predictor_url: str) -> str:
    """``make demo``'s serving stage: the bundled trace's first requests through the real
    proxy and emulator (G = 8, B = 16), as BR-0 and as BR-H asking the live service."""
    from router_client.traces import load_trace

    trace = load_trace(trace_path, "auto", DEMO_REQUESTS)
    config = FleetBenchConfig(workers=8, batch=16, time_scale=0.5)
    rows = []
    with tempfile.TemporaryDirectory(prefix="demo-proxy-") as workdir:
        rows.append(run_policy(trace, "br0", config, workdir))
        rows.append(run_policy(trace, "brh", config, workdir,
                               ("--predictor-url", predictor_url)))
    # what the simulator expects of the same requests and fleet (BR-H learning in process
    # from these completions alone, where the demo's service learned the ab stage's first):
    # the yardstick for the proxy's figures, which swing much more in a run this short
    add_ab_figures(trace, rows, config)
    reference = rows[0]["throughput_tok_s"] or 1.0
    lines = ["(a smoke run of the whole loop, not a measurement: the fleet fills once and then "
             "empties, so tok/s and 'x br0' swing by a few percent between identical runs; "
             "'ab' is balanceroute ab on the same requests; `balanceroute bench proxy-ab` "
             "measures, see the README)",
             f"{'proxy':<6} {'done':>5} {'failed':>6} {'tok/s':>7} {'x br0':>7} {'max-min':>8} "
             f"{'round ms':>8} {'BR-0 rounds':>11} {'wall s':>6} {'ab policy':>14} "
             f"{'ab x br0':>8} {'ab max-min':>10}"]
    for r in rows:
        lines.append(f"{r['policy']:<6} {r['completed']:5d} {r['failed']:6d} "
                     f"{r['throughput_tok_s']:7.0f} {r['throughput_tok_s'] / reference:7.4f} "
                     f"{r['imbalance_maxmin_mean']:8.0f} {r['router_ms_mean']:8.3f} "
                     f"{r['fallback_rounds']:11d} {r['wall_s']:6.0f} {r['ab_policy']:>14} "
                     f"{r['ab_ratio']:8.4f} {r['ab_imbalance_maxmin_mean']:10.0f}")
    return "\n".join(lines)
