"""A barrier-synchronized data-parallel decode fleet, stepped one decode step at a time.

Model (the paper's, arXiv 2605.06113): G workers with B slots each. At every step each active
request reads ``s + a`` KV tokens (prompt plus tokens generated so far) and generates one token; it
leaves when it has generated its output length. Worker g's load ``L_g`` is the sum over its
active requests; the step lasts ``a * max_g L_g + b`` seconds for everyone (the barrier).

Arrivals are in decode steps: ``--load`` rescales the trace's arrival times (keeping their
burst shape) so that the mean arrival rate per step is ``load * G * B / mean(output)``;
traces without times get Poisson arrivals at that rate (seeded). ``backlog`` keeps the pool
topped up to ``4 * G`` requests in trace order. Prefill is not simulated: a request enters the
waiting pool at its arrival step, and the policy sees the oldest ``pool_window`` of them.

Predictions go through :class:`~router_client.prediction.PredictionCache`, the same component
:class:`~router_client.client.RouterClient` runs in production: refresh every
``refresh_steps`` steps (waiting requests included), aging in between, the fallback controller,
``c_hat = H`` for a request admitted without a prediction. Routing rounds of a BR-H policy
run as BR-0 meanwhile count in ``fallback_steps``. Finished requests are reported to the
predictor at the end of the step they finish in, so it never sees a request before it ends.

Structure: :class:`Simulation` owns the run (arrivals, the prediction cache, routing);
:class:`Engine` owns the slots and is the only thing that advances the clock;
:class:`MetricsCollector` records each step and builds the result row.
Determinism: everything random comes from ``seed``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from time import perf_counter

import numpy as np

from .errors import ContractError, ParameterError
from .fallback import FallbackController, Switch
from .fleet import DEFAULT_STEP_COST, ArrivalRate, Assignment, FleetView, WaitingRequest
from .policies import Policy
from .prediction import PredictionCache
from .predictors import ActiveBatch, FinishedBatch, Predictor
from .projection import END_SHAPE
from .traces import Trace

BACKLOG_DEPTH_PER_WORKER = 4

# The arrival rate's range, as a share of the fleet's capacity: far below it the replay's
# step counter (arrival times in steps) would pass what an int64 holds.
MIN_LOAD, MAX_LOAD = 1e-3, 100.0


def check_load(load: float | str) -> None:
    """A replay's ``load``: ``'backlog'`` or a number in [MIN_LOAD, MAX_LOAD]."""
    if isinstance(load, str):
        if load != "backlog":
            raise ParameterError("load", "must be a number or 'backlog'")
    elif isinstance(load, bool) or not MIN_LOAD <= load <= MAX_LOAD:
        raise ParameterError("load", f"must be in [{MIN_LOAD:g}, {MAX_LOAD:g}] (a share of the "
                             f"fleet's capacity) or 'backlog': {load!r}")


STEP_COST_MIN = 1e-12  # seconds: A and B are 0 or at least this (and at most the maxima)
STEP_COST_MAX = (1.0, 10.0)  # A: seconds per KV token; B: seconds per step


def check_step_cost(cost: tuple[float, float]) -> None:
    a, b = cost
    if not (math.isfinite(a) and math.isfinite(b)) or a < 0 or b < 0:
        raise ParameterError("step_cost", "A and B must be finite and >= 0")
    if a == 0 and b == 0:
        raise ParameterError("step_cost", "A and B cannot both be 0")
    for name, value, most, unit in (("A", a, STEP_COST_MAX[0], "s per KV token"),
                                    ("B", b, STEP_COST_MAX[1], "s per step")):
        if value != 0 and not STEP_COST_MIN <= value <= most:  # else rates leave float range
            raise ParameterError("step_cost", f"{name} must be 0 or from {STEP_COST_MIN:g} to "
                                 f"{most:g} {unit}, not {value!r}")


def parse_step_cost(text: str) -> tuple[float, float]:
    """``"A,B"`` (seconds per KV token, fixed seconds per step) for ``--step-cost``."""
    try:
        a, b = (float(v) for v in text.split(","))
    except ValueError:
        raise ParameterError("step_cost", f"takes A,B (two numbers): {text!r}") from None
    check_step_cost((a, b))
    return a, b


ProgressCallback = Callable[[float], None]
StepHook = Callable[[int], None]


@dataclass(frozen=True)
class SimConfig:
    workers: int = 8
    batch: int = 64
    load: float | str = 1.0
    step_cost: tuple[float, float] = DEFAULT_STEP_COST
    horizon: int = 80
    refresh_steps: int = 10
    seed: int = 0
    pool_window: int = 1024
    record_trajectory: bool = False
    healthy_to_return: int = 3
    predict_pool: bool = True

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ParameterError("workers", "must be >= 1")
        if self.batch < 1:
            raise ParameterError("batch", "must be >= 1")
        check_load(self.load)
        check_step_cost(self.step_cost)
        if self.seed < 0:
            raise ParameterError("seed", "must be >= 0")
        if self.horizon < 1:
            raise ParameterError("horizon", "must be >= 1")
        if self.refresh_steps < 1:
            raise ParameterError("refresh_steps", "must be >= 1")
        if self.pool_window < 1:
            raise ParameterError("pool_window", "must be >= 1")

    @property
    def backlog(self) -> bool:
        return isinstance(self.load, str)


@dataclass
class SimResult:
    """One run: the result row of ``balanceroute ab --json`` plus per-step series for plots."""

    row: dict[str, float | int | str | None]
    loads: np.ndarray | None = None  # (steps, G) per-worker load, if recorded
    admit_step: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    finish_step: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    assigned_worker: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    switches: list[Switch] = field(default_factory=list)
    fallback_rounds: list[int] = field(default_factory=list)  # steps routed as BR-0 by BR-H


def arrival_steps(trace: Trace, config: SimConfig) -> np.ndarray:
    """Arrival step of each request (fractional) for a numeric ``load``."""
    if isinstance(config.load, str):
        raise ParameterError("load", "arrival steps need a numeric load, not 'backlog'")
    rate = config.load * config.workers * config.batch / float(trace.output_tokens.mean())
    n = len(trace)
    if trace.arrival_s is None:
        rng = np.random.default_rng(config.seed)
        gaps = rng.exponential(1.0 / rate, n)
        gaps[0] = 0.0
        return np.cumsum(gaps)
    span = float(trace.arrival_s[-1] - trace.arrival_s[0])
    if span <= 0 or n < 2:
        return np.zeros(n)
    steps_per_second = (n / span) / rate  # keep the burst shape, hit the target mean rate
    return (trace.arrival_s - trace.arrival_s[0]) * steps_per_second


class Engine:
    """G workers of B slots: the only owner of the clock.

    Slot ``g * B + j`` is slot j of worker g. Each slot holds a request id (-1 when free), its
    size ``s + a``, tokens generated ``a`` and output length ``o``.
    """

    def __init__(self, workers: int, batch: int, step_cost: tuple[float, float]) -> None:
        self.workers, self.batch = workers, batch
        self.step_cost = step_cost
        a, b = step_cost  # the step's fixed cost in KV tokens (the router's guard reads it)
        self.step_overhead = b / a if a > 0 else float("inf")
        slots = workers * batch
        self.request = np.full(slots, -1, dtype=np.int64)
        self.size = np.zeros(slots, dtype=np.int64)
        self.generated = np.zeros(slots, dtype=np.int64)
        self.output = np.zeros(slots, dtype=np.int64)
        self.worker = np.repeat(np.arange(workers, dtype=np.int64), batch)
        self.clock = 0.0

    @property
    def active(self) -> np.ndarray:
        return self.request >= 0

    def loads(self, active: np.ndarray) -> np.ndarray:
        per_slot = np.where(active, self.size, 0).reshape(self.workers, self.batch)
        return per_slot.sum(axis=1).astype(np.float64)

    def view(self) -> FleetView:
        idx = np.flatnonzero(self.active)
        return FleetView(
            capacity=self.batch,
            loads=np.bincount(self.worker[idx], weights=self.size[idx], minlength=self.workers),
            active_counts=np.bincount(self.worker[idx], minlength=self.workers),
            active_worker=self.worker[idx],
            active_size=self.size[idx].astype(np.float64),
            step_overhead=self.step_overhead,
        )

    def free_slot(self, worker: int) -> int:
        """The first free slot of ``worker``; raises when the worker is full."""
        row = self.request[worker * self.batch:(worker + 1) * self.batch]
        free = np.flatnonzero(row < 0)
        if free.size == 0:
            raise ContractError(f"more than B={self.batch} requests put on worker {worker}")
        return worker * self.batch + int(free[0])

    def place(self, worker: int, request: int, prompt: int, output: int) -> None:
        slot = self.free_slot(worker)
        self.request[slot] = request
        self.size[slot] = prompt
        self.generated[slot] = 0
        self.output[slot] = output

    def idle(self, steps: int) -> None:
        """Nothing runs for ``steps`` steps: the engine ticks at the fixed cost."""
        self.clock += steps * self.step_cost[1]

    def decode(self, active: np.ndarray, top: float) -> tuple[np.ndarray, np.ndarray]:
        """One decode step of every active request (the barrier costs ``a * top + b``).

        Returns the ids that produced their first token and the ids that finished."""
        self.clock += self.step_cost[0] * top + self.step_cost[1]
        started = self.request[np.flatnonzero(active & (self.generated == 0))]
        self.generated += active  # +1 where active (whole-array adds, no masked indexing)
        self.size += active
        done = np.flatnonzero(active & (self.generated >= self.output))
        finished = self.request[done]
        self.request[done] = -1
        return started, finished


class MetricsCollector:
    """Per-step records (an idle stretch is one record of several steps) and per-request
    times; :meth:`row` turns them into the result row of ``balanceroute ab --json``."""

    def __init__(self, n: int) -> None:
        self.weight: list[int] = []
        self.top: list[float] = []
        self.low: list[float] = []
        self.total: list[float] = []
        self.tokens: list[int] = []
        self.steps: list[int] = []
        # G max L - sum L once a step's finished requests have left, before the next round
        # admits: where BF-IO's simulator measures its imbalance (0 for an idle stretch)
        self.after_step: list[float] = []
        self.trajectory: list[np.ndarray] = []
        self.enter_step = np.full(n, -1, dtype=np.int64)
        self.enter_clock = np.zeros(n)
        self.admit_step = np.full(n, -1, dtype=np.int64)
        self.assigned_worker = np.full(n, -1, dtype=np.int64)
        self.first_token_clock = np.full(n, np.nan)
        self.finish_clock = np.full(n, np.nan)
        self.finish_step = np.full(n, -1, dtype=np.int64)
        self.guard_admissions = 0
        self.guard_waits = 0  # workers the guard idle held back, one per worker and round
        self.patience_admissions = 0  # guard admissions of workers out of patience
        self.revisit_admissions = 0  # Stage-2 admissions on a revisit (stage2_revisit)
        # steps with more requests waiting than free slots: some had to wait, and the policy
        # chose which (0: every request found a slot at once, and policies differ only in
        # where they put it; a fleet that never filled tells BR settings nothing apart)
        self.contended_steps = 0
        self.gammas: list[float] = []  # BR-H's discount per round (turnover: it varies)
        self.as_br0_rounds = 0  # BR-H's rounds at gamma 0, routed as BR-0's
        self.br0_check_rounds = 0  # BR-H's rounds that BR-0's round replaced (br0_check)
        self.fallback_rounds: list[int] = []
        self.last_admission_step = -1
        self.completed = 0

    def record(self, weight: int, loads: np.ndarray | None, tokens: int, step: int) -> None:
        self.weight.append(weight)
        self.top.append(float(loads.max()) if loads is not None else 0.0)
        self.low.append(float(loads.min()) if loads is not None else 0.0)
        self.total.append(float(loads.sum()) if loads is not None else 0.0)
        self.tokens.append(tokens)
        self.steps.append(step)
        self.after_step.append(0.0)

    def row(self, name: str, config: SimConfig, outputs: np.ndarray, clock: float,
            final_step: int) -> dict[str, float | int | str | None]:
        a_cost, b_cost = config.step_cost
        G = config.workers
        weight, steps = np.asarray(self.weight), np.asarray(self.steps)
        top, low, total = np.asarray(self.top), np.asarray(self.low), np.asarray(self.total)
        window = steps <= self.last_admission_step
        w = weight[window]
        steps_in_window = float(w.sum()) if w.size else 0.0
        step_time = a_cost * top + b_cost
        busy_time = float((w * step_time[window]).sum())
        tokens_window = float(np.asarray(self.tokens)[window].sum())
        idle = float((w * a_cost * (G * top[window] - total[window])).sum())
        denominator = float((w * G * step_time[window]).sum())
        balanced_time = float((w * (a_cost * total[window] / G + b_cost)).sum())
        last = self.last_admission_step
        drain = int(final_step - (last + 1)) if last >= 0 else 0
        return {
            "policy": name, "workers": G, "batch": config.batch, "requests": int(outputs.size),
            "completed": self.completed,
            "imbalance_maxmin_mean": _mean(w, (top - low)[window], steps_in_window),
            "imbalance_total_mean": _mean(w, (G * top - total)[window], steps_in_window),
            "imbalance_total_after_step_mean": _mean(
                w, np.asarray(self.after_step)[window], steps_in_window),
            "barrier_idle_fraction": idle / denominator if denominator else 0.0,
            "throughput_tok_s": tokens_window / busy_time if busy_time else 0.0,
            "balanced_bound_tok_s": tokens_window / balanced_time if busy_time else 0.0,
            **self._latencies(outputs),
            "starvation_guard_admissions": self.guard_admissions,
            "guard_waits": self.guard_waits,
            "patience_admissions": self.patience_admissions,
            "stage2_revisit_admissions": self.revisit_admissions,
            "contended_steps": self.contended_steps,
            "fallback_steps": len(self.fallback_rounds),
            "gamma_mean": float(np.mean(self.gammas)) if self.gammas else None,
            # BR-H's rounds with predictions, and those of them at gamma 0 (or an effective
            # horizon below ``myopic_horizon``) that BR-H routed as BR-0 (scored as BR-0; its
            # guard and Stage 2 too under ``zero_gamma_rules`` "br0"): how often the
            # lookahead had a say
            "lookahead_rounds": len(self.gammas),
            "gamma_zero_rounds": self.as_br0_rounds,
            "br0_check_rounds": self.br0_check_rounds,
            "drain_steps": drain, "makespan_s": clock, "routing_steps": int(steps_in_window),
            # every output token over the whole run, drain included: the same work for every
            # policy, so its ratio is not moved by which requests a policy left for the drain
            "run_throughput_tok_s": float(sum(self.tokens)) / clock if clock else 0.0,
        }

    def _latencies(self, outputs: np.ndarray) -> dict[str, float | None]:
        last = self.last_admission_step
        done = (self.finish_step >= 0) & (self.finish_step <= last) & (outputs > 1)
        tpot = ((self.finish_clock[done] - self.first_token_clock[done])
                / (outputs[done] - 1))
        ttft = self.first_token_clock - self.enter_clock
        wait = (self.admit_step - self.enter_step)[self.admit_step >= 0].astype(np.float64)
        return {
            "tpot_p50_ms": _percentile(tpot, 50, 1000.0),
            "tpot_p95_ms": _percentile(tpot, 95, 1000.0),
            "ttft_p95_ms": _percentile(ttft, 95, 1000.0),
            "pool_wait_p95_steps": _percentile(wait, 95),
        }


class Simulation:
    """One replay of ``trace`` through ``policy``; :meth:`run` returns the result.

    ``step_hook(step)`` is called at the start of every step (tests use it to stop and start
    a live prediction service mid-run).
    """

    def __init__(self, trace: Trace, policy: Policy, config: SimConfig,
                 predictor: Predictor | None = None, progress: ProgressCallback | None = None,
                 step_hook: StepHook | None = None,
                 fallback: FallbackController | None = None) -> None:
        self.trace, self.policy, self.config = trace, policy, config
        self.predictor = predictor if policy.needs_predictions else None
        self.progress, self.step_hook = progress, step_hook
        self.prompts = trace.prompt_tokens.astype(np.int64)
        self.outputs = trace.output_tokens.astype(np.int64)
        self.arrivals = None if config.backlog else arrival_steps(trace, config)
        self.engine = Engine(config.workers, config.batch, config.step_cost)
        self.metrics = MetricsCollector(len(trace))
        self.cache = PredictionCache(
            self.predictor, config.horizon if policy.needs_predictions else 0,
            config.refresh_steps, fallback or FallbackController(config.healthy_to_return),
            getattr(getattr(policy, "params", None), "end_shape", END_SHAPE))
        self.pool: list[WaitingRequest] = []
        self.assigned = np.zeros(len(trace), dtype=bool)
        self.next_request = 0
        self.step = 0
        self.arrivals_seen = ArrivalRate()  # requests entering the pool per step
        self._next_report = 0.0

    def run(self) -> SimResult:
        started = perf_counter()
        while self._advance():
            pass
        if self.progress is not None:
            self.progress(1.0)
        row = self.metrics.row(self.policy.name, self.config, self.outputs, self.engine.clock,
                               self.step)
        row["sim_wall_s"] = round(perf_counter() - started, 3)
        m = self.metrics
        loads = np.asarray(m.trajectory) if self.config.record_trajectory else None
        return SimResult(row, loads, m.admit_step, m.finish_step, m.assigned_worker,
                         list(self.cache.controller.switches), m.fallback_rounds)

    def _advance(self) -> bool:
        """One step: arrivals, refresh, routing round, decode. False when the run is over."""
        if self.step_hook is not None:
            self.step_hook(self.step)
        self._arrive()
        if self.cache.due(self.step):
            self._refresh()
        active = self.engine.active
        if len(self.pool) > active.size - int(active.sum()):
            self.metrics.contended_steps += 1
        if self.pool and not active.all():
            self._route()
            active = self.engine.active
        if not active.any():
            if self.next_request >= len(self.trace) and not self.pool:
                return False
            if not self.pool and self.arrivals is not None:
                self._idle_until_next_arrival()
                return True
        self._decode(active)
        return True

    def _arrive(self) -> None:
        n, step, before = len(self.trace), self.step, self.next_request
        if self.arrivals is None:
            limit = BACKLOG_DEPTH_PER_WORKER * self.config.workers
            while len(self.pool) < limit and self.next_request < n:
                self._enqueue(self.next_request)
        else:
            while self.next_request < n and self.arrivals[self.next_request] <= step:
                self._enqueue(self.next_request)
        self.arrivals_seen.add(self.next_request - before)

    def _enqueue(self, request: int) -> None:
        self.pool.append(WaitingRequest(request, int(self.prompts[request]), self.step,
                                        self.trace.prompt_keys[request]))
        self.metrics.enter_step[request] = self.step
        self.metrics.enter_clock[request] = self.engine.clock
        self.next_request += 1

    def _refresh(self) -> None:
        engine = self.engine
        idx = np.flatnonzero(engine.active)
        waiting = (np.fromiter((r.request_id for r in self.pool[: self.config.pool_window]),
                               dtype=np.int64) if self.config.predict_pool
                   else np.zeros(0, dtype=np.int64))
        asked = np.concatenate([engine.request[idx], waiting])
        batch = ActiveBatch(
            asked, self.prompts[asked],
            np.concatenate([engine.generated[idx], np.zeros(waiting.size, dtype=np.int64)]),
            [self.trace.prompt_keys[r] for r in asked],
        )
        self.cache.refresh(self.step, batch, int(idx.size))

    def _route(self) -> None:
        visible = self.pool[: self.config.pool_window]
        view = replace(self.engine.view(), arrival_rate=self.arrivals_seen.rate)
        if self.policy.needs_predictions:
            active = self.engine.active
            view = self.cache.annotate(view, self.engine.request[active].tolist(),
                                       [r.request_id for r in visible], self.step,
                                       self.engine.generated[active])
            if view.active_c_hat is None:
                self.metrics.fallback_rounds.append(self.step)
        decision = self.policy.route(view, visible)
        stats = decision.stats
        if "gamma" in stats.extra:
            self.metrics.gammas.append(stats.extra["gamma"])
        self.metrics.as_br0_rounds += int(stats.extra.get("as_br0", False))
        self.metrics.br0_check_rounds += int(stats.extra.get("br0_check", False))
        self.metrics.guard_waits += len(stats.waited)
        self.metrics.patience_admissions += stats.patience_admissions
        self.metrics.revisit_admissions += stats.revisit_admissions
        if not decision.assignments:
            return
        taken: set[int] = set()
        for assignment in decision.assignments:
            self._check(assignment, taken, visible)
            taken.add(assignment.pool_index)
            self._admit(int(visible[assignment.pool_index].request_id), assignment)
        self.pool = ([r for i, r in enumerate(visible) if i not in taken]
                     + self.pool[len(visible):])
        self.metrics.last_admission_step = self.step

    def _check(self, assignment: Assignment, taken: set[int],
               visible: list[WaitingRequest]) -> None:
        index, worker = assignment.pool_index, assignment.worker
        if not 0 <= index < len(visible):
            raise ContractError(f"assignment of pool index {index}, which is not in the pool")
        if index in taken:
            raise ContractError(f"pool index {index} assigned twice in one round")
        if not 0 <= worker < self.config.workers:
            raise ContractError(f"assignment to worker {worker}, which does not exist")

    def _admit(self, request: int, assignment: Assignment) -> None:
        if self.assigned[request]:
            raise ContractError(f"policy {self.policy.name} admitted request {request} twice")
        self.engine.place(assignment.worker, request, int(self.prompts[request]),
                          int(self.outputs[request]))
        self.assigned[request] = True
        self.metrics.assigned_worker[request] = assignment.worker
        self.metrics.admit_step[request] = self.step
        self.metrics.guard_admissions += int(assignment.starvation_guard)
        self.cache.on_admit(request, self.step)

    def _idle_until_next_arrival(self) -> None:
        arrivals = self.arrivals
        if arrivals is None:
            raise ContractError("idle stretch without timed arrivals")
        target = max(self.step + 1, int(np.ceil(arrivals[self.next_request])))
        idle = target - self.step
        self.metrics.record(idle, None, 0, self.step)
        self.engine.idle(idle)
        if idle > 1:  # the steps skipped, none with an arrival (this step's was counted)
            self.arrivals_seen.add(0, idle - 1)
        self.step = target

    def _decode(self, active: np.ndarray) -> None:
        engine, m = self.engine, self.metrics
        loads = engine.loads(active)
        m.record(1, loads, int(active.sum()), self.step)
        if self.config.record_trajectory:
            m.trajectory.append(loads.astype(np.float32))
        first, finished = engine.decode(active, float(loads.max()))
        after = engine.loads(engine.active)
        m.after_step[-1] = float(after.size * after.max() - after.sum())
        m.first_token_clock[first] = engine.clock
        if finished.size:
            m.finish_clock[finished] = engine.clock
            m.finish_step[finished] = self.step
            m.completed += int(finished.size)
            self.cache.forget(finished.tolist())
            if self.predictor is not None:
                self.predictor.observe(FinishedBatch(
                    finished, self.prompts[finished], self.outputs[finished],
                    self.trace.censored[finished],
                    [self.trace.prompt_keys[r] for r in finished],
                ))
        self.step += 1
        n = len(self.trace)
        if self.progress is not None and m.completed / n >= self._next_report:
            self.progress(m.completed / n)
            self._next_report = m.completed / n + 0.01


def simulate(
    trace: Trace,
    policy: Policy,
    config: SimConfig,
    predictor: Predictor | None = None,
    progress: ProgressCallback | None = None,
    step_hook: StepHook | None = None,
    fallback: FallbackController | None = None,
) -> SimResult:
    """Replay ``trace`` through ``policy``; returns the result row (see :class:`Simulation`)."""
    return Simulation(trace, policy, config, predictor, progress, step_hook, fallback).run()


def _percentile(values: np.ndarray, q: float, scale: float = 1.0) -> float | None:
    """Percentile of the finite values; ``None`` (JSON null) when there are none."""
    values = values[np.isfinite(values)]
    return scale * float(np.percentile(values, q)) if values.size else None


def bound_share(row: dict) -> float:
    """A result row's throughput over its own balanced bound (``ab``'s ``of bound``): the
    routing's share of perfect balance of the same work. Unlike throughput it does not move
    with how much work the routing window held, so a policy cannot raise it by leaving heavy
    requests for after the window (README, "What a throughput ratio is made of"). 0 without
    a bound."""
    bound = row.get("balanced_bound_tok_s") or 0.0
    return row["throughput_tok_s"] / bound if bound else 0.0


def _mean(weight: np.ndarray, values: np.ndarray, total_weight: float) -> float:
    return float((weight * values).sum() / total_weight) if total_weight else 0.0
