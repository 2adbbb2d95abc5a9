"""``balanceroute bench router``: time whole BR-H scheduling rounds.

Fleet states are sampled from a simulated run (``synth:long``, decode-heavy like the paper's
traces, saturated: ``--load backlog``, BR-H with oracle predictions) once at most 10% of the
slots (or one) are free. Each state's pool is the run's own pool, padded to ``pool`` waiting
requests with prompts drawn from the same trace. Every round (projection, envelope, both
stages, subset selection) is timed with ``perf_counter``.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from .admission import BalanceRouteParams, route_round
from .fleet import FleetView, WaitingRequest
from .policies import BalanceRoutePolicy, Decision
from .predictors import OraclePredictor
from .simulator import SimConfig, simulate
from .synth import synthesize


@dataclass
class _Recorder:
    """Routes with BR-H and keeps every ``stride``-th full-enough fleet state."""

    inner: BalanceRoutePolicy
    capacity_slots: int
    stride: int
    states: list[tuple[FleetView, list[WaitingRequest]]] = field(default_factory=list)
    calls: int = 0

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def needs_predictions(self) -> bool:
        return True

    def route(self, fleet: FleetView, pool: list[WaitingRequest]) -> Decision:
        self.calls += 1
        full = fleet.free_slots.sum() <= max(1.0, 0.1 * self.capacity_slots)
        if full and fleet.active_c_hat is not None and self.calls % self.stride == 0:
            self.states.append((fleet, list(pool)))
        return self.inner.route(fleet, pool)


def sample_states(workers: int, batch: int, horizon: int, seed: int, wanted: int
                  ) -> tuple[list[tuple[FleetView, list[WaitingRequest]]], np.ndarray]:
    n = max(4000, workers * batch * 5)
    trace = synthesize(f"synth:long:n={n},seed={seed}")
    params = BalanceRouteParams(horizon=horizon)
    recorder = _Recorder(BalanceRoutePolicy("brh-oracle", params), workers * batch, stride=1)
    config = SimConfig(workers=workers, batch=batch, load="backlog", horizon=horizon, seed=seed)
    simulate(trace, recorder, config, OraclePredictor(trace.output_tokens))
    states = recorder.states
    if len(states) > wanted:
        picks = np.linspace(0, len(states) - 1, wanted).astype(int)
        states = [states[i] for i in picks]
    return states, trace.prompt_tokens


def bench_router(workers: int = 8, rmax: int = 4, pool: int = 256, batch: int = 64,
                 horizon: int = 80, rounds: int = 2000, seed: int = 0) -> dict:
    states, prompts = sample_states(workers, batch, horizon, seed, rounds)
    if not states:
        raise RuntimeError("the simulated run never filled the fleet; no states to time")
    params = BalanceRouteParams(horizon=horizon, r_max=rmax)
    paper = BalanceRouteParams.paper(horizon=horizon, r_max=rmax)
    rng = np.random.default_rng(seed)
    times: list[float] = []
    paper_times: list[float] = []
    stage2: list[float] = []
    admitted: list[int] = []
    for index in range(rounds):
        fleet, own_pool = states[index % len(states)]
        padding = rng.choice(prompts, size=max(0, pool - len(own_pool)))
        waiting = own_pool[:pool] + [
            WaitingRequest(f"pad-{k}", int(s)) for k, s in enumerate(padding)
        ]
        started = perf_counter()
        route_round(fleet, waiting, paper)  # the paper's form, timed in the same run
        paper_times.append(perf_counter() - started)
        started = perf_counter()
        assignments, stats = route_round(fleet, waiting, params)
        times.append(perf_counter() - started)
        stage2.append(stats.extra.get("stage2_s", 0.0))
        admitted.append(len(assignments))
    ms = np.asarray(times) * 1000.0
    paper_ms = np.asarray(paper_times) * 1000.0
    return {
        "paper_form_p50_ms": round(float(np.percentile(paper_ms, 50)), 4),
        "paper_form_p99_ms": round(float(np.percentile(paper_ms, 99)), 4),
        "workers": workers, "rmax": rmax, "pool": pool, "rounds": rounds,
        "p50_ms": round(float(np.percentile(ms, 50)), 4),
        "p99_ms": round(float(np.percentile(ms, 99)), 4),
        "mean_ms": round(float(ms.mean()), 4),
        "stage2_share": round(float(np.sum(stage2) / np.sum(times)), 4),
        "batch": batch, "horizon": horizon, "distinct_states": len(states),
        "mean_admitted_per_round": round(float(np.mean(admitted)), 3),
        "python": platform.python_version(),
    }
