"""``balanceroute bench router``: time whole BR-H (or, with ``horizon=0``, BR-0) rounds.

Each state is routed three ways in the same run: the default path, the pure-Python/numpy
reference (``route_round(..., reference=True)``; the two must agree) and, for BR-H, the
paper's form.

Fleet states are sampled from a simulated run (``synth:long``, decode-heavy like the paper's
traces, saturated: ``--load backlog``, BR-H with oracle predictions, or with a learned
``predictor`` whose law of remaining life, ``p_fin`` and ``mu_rem``, the round then projects
and scores with its spread) once at most 10% of the slots (or one) are free. Each state's
pool is the run's own pool, padded to ``pool`` waiting requests with prompts drawn from the
same trace. Every round (projection, envelope, both
stages, subset selection) is timed with ``perf_counter``.
"""

from __future__ import annotations

import gc
import os
import platform
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from .admission import BalanceRouteParams, route_round
from .fleet import FleetView, WaitingRequest
from .policies import BalanceRoutePolicy, Decision
from .predictors import OraclePredictor, Predictor
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
        return self.inner.needs_predictions

    def route(self, fleet: FleetView, pool: list[WaitingRequest]) -> Decision:
        self.calls += 1
        full = fleet.free_slots.sum() <= max(1.0, 0.1 * self.capacity_slots)
        predicted = fleet.active_c_hat is not None or not self.inner.needs_predictions
        if full and predicted and self.calls % self.stride == 0:
            self.states.append((fleet, list(pool)))
        return self.inner.route(fleet, pool)


def sample_states(workers: int, batch: int, horizon: int, seed: int, wanted: int,
                  predictor: Predictor | None = None, name: str = "brh-oracle",
                  ) -> tuple[list[tuple[FleetView, list[WaitingRequest]]], np.ndarray]:
    """Full-enough fleet states of a saturated ``synth:long`` run routed by BR-H (BR-0 when
    ``horizon`` is 0) with ``predictor`` (default: the true lengths)."""
    slots = workers * batch
    n = max(min(4000, 60 * slots), 5 * slots)  # a tiny fleet (tests) needs no 4,000
    trace = synthesize(f"synth:long:n={n},seed={seed}")
    params = BalanceRouteParams(horizon=horizon)
    recorder = _Recorder(BalanceRoutePolicy(name if horizon else "br0", params),
                         workers * batch, stride=1)
    config = SimConfig(workers=workers, batch=batch, load="backlog", horizon=max(horizon, 1),
                       seed=seed)
    simulate(trace, recorder, config, predictor or OraclePredictor(trace.output_tokens))
    states = recorder.states
    if len(states) > wanted:
        picks = np.linspace(0, len(states) - 1, wanted).astype(int)
        states = [states[i] for i in picks]
    return states, trace.prompt_tokens


def bench_router(workers: int = 8, rmax: int | None = None, pool: int = 256, batch: int = 64,
                 horizon: int = 80, rounds: int = 2000, seed: int = 0,
                 predictor: Predictor | None = None, policy: str = "brh-oracle") -> dict:
    """Time rounds of the default path, the pure-Python/numpy reference (``reference=True``)
    and, for BR-H, the paper's form, interleaved on the same states. ``horizon=0``: BR-0.
    ``predictor`` (named ``policy`` in the result): where the states' predictions come from
    (default: the true lengths)."""
    states, prompts = sample_states(workers, batch, horizon, seed, rounds, predictor, policy)
    if not states:
        raise RuntimeError("the simulated run never filled the fleet; no states to time")
    if horizon:
        params = BalanceRouteParams(horizon=horizon, r_max=rmax)
        paper: BalanceRouteParams | None = BalanceRouteParams.paper(horizon=horizon, r_max=rmax)
    else:
        params, paper = BalanceRouteParams.br0(r_max=rmax), None
    rng = np.random.default_rng(seed)
    # The sampling run leaves a large heap; freeze it so that cyclic GC passes during the timed
    # rounds do not walk it (a router process does the same after start-up, as the service).
    gc.collect()
    gc.freeze()
    load_before = os.getloadavg()[0]
    times: dict[str, list[float]] = {"fast": [], "reference": [], "paper": []}
    stage2: list[float] = []
    admitted: list[int] = []
    for index in range(rounds):
        fleet, own_pool = states[index % len(states)]
        padding = rng.choice(prompts, size=max(0, pool - len(own_pool)))
        waiting = own_pool[:pool] + [
            WaitingRequest(f"pad-{k}", int(s)) for k, s in enumerate(padding)
        ]
        if paper is not None:
            started = perf_counter()
            route_round(fleet, waiting, paper)  # the paper's form, timed in the same run
            times["paper"].append(perf_counter() - started)
        started = perf_counter()
        reference, _ = route_round(fleet, waiting, params, reference=True)
        times["reference"].append(perf_counter() - started)
        started = perf_counter()
        assignments, stats = route_round(fleet, waiting, params)
        times["fast"].append(perf_counter() - started)
        if assignments != reference:
            raise RuntimeError("the fast path and the reference decided differently")
        stage2.append(stats.extra.get("stage2_s", 0.0))
        admitted.append(len(assignments))
    gc.unfreeze()
    load_after = os.getloadavg()[0]
    return {
        "policy": policy if horizon else "br0",
        "workers": workers, "rmax": params.effective_r_max(workers), "pool": pool,
        "rounds": rounds,
        **_percentiles("", times["fast"]),
        **_percentiles("reference_", times["reference"]),
        **(_percentiles("paper_form_", times["paper"]) if times["paper"] else {}),
        "stage2_share": round(float(np.sum(stage2) / np.sum(times["fast"])), 4),
        "batch": batch, "horizon": horizon, "distinct_states": len(states),
        "mean_admitted_per_round": round(float(np.mean(admitted)), 3),
        "python": platform.python_version(),
        # 1-minute load average when the timed rounds started and ended (the figures are
        # wall-clock times on a shared machine: read them with it)
        "load_average": [round(load_before, 2), round(load_after, 2)],
        "cpus": os.cpu_count(),
    }


def _percentiles(prefix: str, seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1000.0
    return {f"{prefix}p50_ms": round(float(np.percentile(ms, 50)), 4),
            f"{prefix}p99_ms": round(float(np.percentile(ms, 99)), 4),
            f"{prefix}mean_ms": round(float(ms.mean()), 4)}
