"""A barrier-synchronized data-parallel decode fleet, stepped one decode step at a time.

Model (SPEC.md section 2): G workers with B slots each. At every step each active request
reads ``s + a`` KV tokens (prompt plus tokens generated so far) and generates one token; it
leaves when it has generated its output length. Worker g's load ``L_g`` is the sum over its
active requests; the step lasts ``a * max_g L_g + b`` seconds for everyone (the barrier).

Arrivals are in decode steps: ``--load`` rescales the trace's arrival times (keeping their
burst shape) so that the mean arrival rate per step is ``load * G * B / mean(output)``;
traces without times get Poisson arrivals at that rate (seeded). ``backlog`` keeps the pool
topped up to ``4 * G`` requests in trace order. Prefill is not simulated: a request enters the
waiting pool at its arrival step, and the policy sees the oldest ``pool_window`` of them.

Predictions: a policy that needs them gets ``c_hat`` for every active request from the
predictor, refreshed every ``refresh_steps`` steps; in between, the last answer is aged by
the steps elapsed (``max(c_hat - elapsed, 1)``; an answer at the cap H stays at H, since
"at least H" says nothing about when). Each refresh also asks about the oldest
``pool_window`` waiting requests (0 tokens generated, ``predict_pool``), so a request admitted
between refreshes starts with its own prediction; one admitted without any counts as
``c_hat = H`` (the conservative prior) until the next refresh. A :class:`FallbackController` decides
after each refresh whether BR-H may use predictions: a failed or drifted refresh switches to
BR-0 at once, ``healthy_to_return`` healthy refreshes switch back. Routing rounds of a BR-H
policy run as BR-0 meanwhile count in ``fallback_steps``. Finished
requests are reported to the predictor at the end of the step they finish in, so it never sees
a request before it ends.

Determinism: everything random comes from ``seed``; the clock is advanced only here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from .errors import ParameterError
from .fallback import FallbackController, Switch
from .fleet import FleetView, WaitingRequest
from .policies import Policy
from .predictors import ActiveBatch, FinishedBatch, Predictor, aged_c_hat
from .traces import Trace

# Default step-time model: about 0.15 us per KV token and 10 ms fixed per step. With the
# paper's deployment (G = 8, B = 64, contexts of 4-5k tokens) the most loaded worker reads
# about 300k KV tokens, which gives 45 ms + 10 ms: close to the ~60 ms decode step the paper
# reports, and bandwidth-dominated as it observed at typical load.
DEFAULT_STEP_COST = (1.5e-7, 0.010)
BACKLOG_DEPTH_PER_WORKER = 4

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
        if isinstance(self.load, str):
            if self.load != "backlog":
                raise ParameterError("load", "must be a positive number or 'backlog'")
        elif not self.load > 0:
            raise ParameterError("load", "must be > 0")
        if self.step_cost[0] < 0 or self.step_cost[1] < 0:
            raise ParameterError("step_cost", "A and B must be >= 0")
        if self.step_cost[0] == 0 and self.step_cost[1] == 0:
            raise ParameterError("step_cost", "A and B cannot both be 0")
        if self.horizon < 1:
            raise ParameterError("horizon", "must be >= 1")
        if self.refresh_steps < 1:
            raise ParameterError("refresh_steps", "must be >= 1")
        if self.pool_window < 1:
            raise ParameterError("pool_window", "must be >= 1")


@dataclass
class SimResult:
    """One run: the API.md result row plus per-step series for plots."""

    row: dict[str, float | int | str | None]
    loads: np.ndarray | None = None  # (steps, G) per-worker load, if recorded
    admit_step: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    finish_step: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    assigned_worker: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    switches: list[Switch] = field(default_factory=list)
    fallback_rounds: list[int] = field(default_factory=list)  # steps routed as BR-0 by BR-H


def arrival_steps(trace: Trace, config: SimConfig) -> np.ndarray:
    """Arrival step of each request (fractional) for a numeric ``load``."""
    assert not isinstance(config.load, str)
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


def simulate(
    trace: Trace,
    policy: Policy,
    config: SimConfig,
    predictor: Predictor | None = None,
    progress: ProgressCallback | None = None,
    step_hook: StepHook | None = None,
    fallback: FallbackController | None = None,
) -> SimResult:
    """Replay ``trace`` through ``policy``; returns the result row.

    ``step_hook(step)`` is called at the start of every step (tests use it to stop and start
    a live prediction service mid-run).
    """
    started = perf_counter()
    G, B = config.workers, config.batch
    a_cost, b_cost = config.step_cost
    H = config.horizon
    n = len(trace)
    prompts = trace.prompt_tokens.astype(np.int64)
    outputs = trace.output_tokens.astype(np.int64)
    backlog = isinstance(config.load, str)
    arrivals = None if backlog else arrival_steps(trace, config)
    use_predictions = policy.needs_predictions and predictor is not None
    controller = fallback or FallbackController(config.healthy_to_return)
    fallback_rounds: list[int] = []

    slots = G * B
    slot_req = np.full(slots, -1, dtype=np.int64)
    slot_size = np.zeros(slots, dtype=np.int64)  # s + a
    slot_gen = np.zeros(slots, dtype=np.int64)  # a
    slot_out = np.zeros(slots, dtype=np.int64)  # o
    slot_chat = np.full(slots, float(H))  # c_hat at the last refresh
    slot_chat_step = np.full(slots, -1, dtype=np.int64)
    slot_worker = np.repeat(np.arange(G, dtype=np.int64), B)

    enter_step = np.full(n, -1, dtype=np.int64)
    enter_clock = np.zeros(n)
    admit_step = np.full(n, -1, dtype=np.int64)
    first_token_clock = np.full(n, np.nan)
    finish_clock = np.full(n, np.nan)
    finish_step = np.full(n, -1, dtype=np.int64)
    assigned = np.zeros(n, dtype=bool)
    assigned_worker = np.full(n, -1, dtype=np.int64)
    pool_chat = np.full(n, np.nan)  # c_hat of waiting requests, from the last refresh

    pool: list[WaitingRequest] = []
    next_request = 0
    step = 0
    clock = 0.0
    last_admission_step = -1
    last_refresh = -(10**9)
    have_prediction = False
    fallback_steps = 0
    guard_admissions = 0
    completed = 0

    # per-step records (weight: idle stretches are one record of several steps)
    rec_weight: list[int] = []
    rec_max: list[float] = []
    rec_min: list[float] = []
    rec_sum: list[float] = []
    rec_tokens: list[int] = []
    rec_step: list[int] = []
    trajectory: list[np.ndarray] = []
    next_report = 0.0

    while True:
        if step_hook is not None:
            step_hook(step)
        # 1. arrivals into the pool
        if backlog:
            while len(pool) < BACKLOG_DEPTH_PER_WORKER * G and next_request < n:
                _enqueue(pool, next_request, prompts, trace, step)
                enter_step[next_request], enter_clock[next_request] = step, clock
                next_request += 1
        else:
            assert arrivals is not None
            while next_request < n and arrivals[next_request] <= step:
                _enqueue(pool, next_request, prompts, trace, step)
                enter_step[next_request], enter_clock[next_request] = step, clock
                next_request += 1

        active = slot_req >= 0
        free_total = slots - int(active.sum())

        # 2. predictions, refreshed every refresh_steps
        if use_predictions and step - last_refresh >= config.refresh_steps:
            assert predictor is not None
            last_refresh = step
            idx = np.flatnonzero(active)
            waiting = (np.fromiter((r.request_id for r in pool[: config.pool_window]),
                                   dtype=np.int64) if config.predict_pool else
                       np.zeros(0, dtype=np.int64))
            asked = np.concatenate([slot_req[idx], waiting])
            batch = ActiveBatch(
                asked,
                prompts[asked],
                np.concatenate([slot_gen[idx], np.zeros(waiting.size, dtype=np.int64)]),
                [trace.prompt_keys[r] for r in asked],
            )
            prediction = predictor.predict(batch, H)
            if prediction.c_hat is None:
                healthy, reason = False, "unavailable"
            elif prediction.drifted:
                healthy, reason = False, "drifted"
            else:
                healthy, reason = True, "ok"
            if prediction.c_hat is not None and not prediction.drifted:
                slot_chat[idx] = prediction.c_hat[: idx.size]
                slot_chat_step[idx] = step
                pool_chat[waiting] = prediction.c_hat[idx.size:]
            have_prediction = controller.on_refresh(step, healthy, reason) and (
                bool((slot_chat_step >= 0).any()) or not idx.size
            )

        # 3. routing round
        if pool and free_total > 0:
            idx = np.flatnonzero(active)
            c_hat = None
            if use_predictions and have_prediction:
                known = slot_chat_step[idx] >= 0
                aged = aged_c_hat(slot_chat[idx], step - slot_chat_step[idx], H)
                c_hat = np.where(known, aged, float(H))
            elif policy.needs_predictions:
                fallback_steps += 1
                fallback_rounds.append(step)
            view = FleetView(
                capacity=B,
                loads=np.bincount(slot_worker[idx], weights=slot_size[idx], minlength=G),
                active_counts=np.bincount(slot_worker[idx], minlength=G),
                active_worker=slot_worker[idx],
                active_size=slot_size[idx].astype(np.float64),
                active_c_hat=c_hat,
            )
            visible = pool[: config.pool_window]
            decision = policy.route(view, visible)
            if decision.assignments:
                taken: set[int] = set()
                free_by_worker = (slot_req.reshape(G, B) < 0)
                for assignment in decision.assignments:
                    _check_assignment(assignment.pool_index, assignment.worker, taken, visible, G)
                    taken.add(assignment.pool_index)
                    row = free_by_worker[assignment.worker]
                    free_slots = np.flatnonzero(row)
                    if free_slots.size == 0:
                        raise AssertionError(
                            f"policy {policy.name} put more than B={B} requests on worker "
                            f"{assignment.worker}"
                        )
                    row[free_slots[0]] = False
                    slot = assignment.worker * B + int(free_slots[0])
                    request = int(visible[assignment.pool_index].request_id)
                    if assigned[request]:
                        raise AssertionError(
                            f"policy {policy.name} admitted request {request} twice"
                        )
                    assigned[request] = True
                    assigned_worker[request] = assignment.worker
                    slot_req[slot] = request
                    slot_size[slot] = prompts[request]
                    slot_gen[slot] = 0
                    slot_out[slot] = outputs[request]
                    if np.isfinite(pool_chat[request]):  # predicted while it waited
                        slot_chat[slot] = pool_chat[request]
                        slot_chat_step[slot] = step
                    else:
                        slot_chat_step[slot] = -1
                    admit_step[request] = step
                    guard_admissions += int(assignment.starvation_guard)
                pool = [r for i, r in enumerate(visible) if i not in taken] + pool[len(visible):]
                last_admission_step = step
                active = slot_req >= 0

        # 4. the decode step
        n_active = int(active.sum())
        if n_active == 0:
            if next_request >= n and not pool:
                break
            if not pool and arrivals is not None:
                # idle until the next arrival: the engine ticks at the fixed cost
                target = max(step + 1, int(np.ceil(arrivals[next_request])))
                idle = target - step
                _record(rec_weight, rec_max, rec_min, rec_sum, rec_tokens, rec_step,
                        idle, 0.0, 0.0, 0.0, 0, step)
                clock += idle * b_cost
                step = target
                continue
        loads = np.bincount(slot_worker[active], weights=slot_size[active], minlength=G)
        top = float(loads.max())
        _record(rec_weight, rec_max, rec_min, rec_sum, rec_tokens, rec_step,
                1, top, float(loads.min()), float(loads.sum()), n_active, step)
        if config.record_trajectory:
            trajectory.append(loads.astype(np.float32))
        clock += a_cost * top + b_cost
        new = active & (slot_gen == 0)
        first_token_clock[slot_req[new]] = clock
        slot_gen[active] += 1
        slot_size[active] += 1
        done = active & (slot_gen >= slot_out)
        if done.any():
            ids = slot_req[done]
            finish_clock[ids] = clock
            finish_step[ids] = step
            completed += int(ids.size)
            if predictor is not None:
                predictor.observe(FinishedBatch(
                    ids, prompts[ids], outputs[ids], trace.censored[ids],
                    [trace.prompt_keys[r] for r in ids],
                ))
            slot_req[done] = -1
        step += 1
        if progress is not None and completed / n >= next_report:
            progress(completed / n)
            next_report = completed / n + 0.01

    if progress is not None:
        progress(1.0)
    row = _metrics(
        policy.name, config, n, completed, clock,
        np.asarray(rec_weight), np.asarray(rec_max), np.asarray(rec_min), np.asarray(rec_sum),
        np.asarray(rec_tokens), np.asarray(rec_step), last_admission_step,
        enter_step, enter_clock, admit_step, first_token_clock, finish_clock, finish_step,
        outputs, guard_admissions, fallback_steps, step,
    )
    row["sim_wall_s"] = round(perf_counter() - started, 3)
    traj = np.asarray(trajectory) if config.record_trajectory else None
    return SimResult(row, traj, admit_step, finish_step, assigned_worker,
                     list(controller.switches), fallback_rounds)


def _enqueue(pool: list[WaitingRequest], request: int, prompts: np.ndarray, trace: Trace,
             step: int) -> None:
    pool.append(WaitingRequest(request, int(prompts[request]), step, trace.prompt_keys[request]))


def _check_assignment(index: int, worker: int, taken: set[int], visible: list, G: int) -> None:
    if not 0 <= index < len(visible):
        raise AssertionError(f"assignment of pool index {index}, which is not in the pool")
    if index in taken:
        raise AssertionError(f"pool index {index} assigned twice in one round")
    if not 0 <= worker < G:
        raise AssertionError(f"assignment to worker {worker}, which does not exist")


def _record(weights, maxes, mins, sums, tokens, steps, weight, top, low, total, n_tokens,
            step) -> None:
    weights.append(weight)
    maxes.append(top)
    mins.append(low)
    sums.append(total)
    tokens.append(n_tokens)
    steps.append(step)


def _percentile(values: np.ndarray, q: float, scale: float = 1.0) -> float | None:
    """Percentile of the finite values; ``None`` (JSON null) when there are none."""
    values = values[np.isfinite(values)]
    return scale * float(np.percentile(values, q)) if values.size else None


def _metrics(
    name, config, n, completed, clock, weight, top, low, total, tokens, steps,
    last_admission_step, enter_step, enter_clock, admit_step, first_token_clock, finish_clock,
    finish_step, outputs, guard_admissions, fallback_steps, final_step,
) -> dict[str, float | int | str | None]:
    a_cost, b_cost = config.step_cost
    G = config.workers
    window = steps <= last_admission_step
    w = weight[window]
    steps_in_window = float(w.sum()) if w.size else 0.0
    step_time = a_cost * top + b_cost
    balanced_time = a_cost * total / G + b_cost
    busy_time = float((w * step_time[window]).sum())
    tokens_window = float((tokens[window]).sum())
    idle = float((w * a_cost * (G * top[window] - total[window])).sum())
    denominator = float((w * G * step_time[window]).sum())
    in_window = (finish_step >= 0) & (finish_step <= last_admission_step) & (outputs > 1)
    tpot = (finish_clock[in_window] - first_token_clock[in_window]) / (outputs[in_window] - 1)
    ttft = first_token_clock - enter_clock
    wait = (admit_step - enter_step)[admit_step >= 0].astype(np.float64)
    drain_steps = int(final_step - (last_admission_step + 1)) if last_admission_step >= 0 else 0
    return {
        "policy": name,
        "workers": G,
        "batch": config.batch,
        "requests": n,
        "completed": completed,
        "imbalance_maxmin_mean": _safe_mean(w, (top - low)[window], steps_in_window),
        "imbalance_total_mean": _safe_mean(w, (G * top - total)[window], steps_in_window),
        "barrier_idle_fraction": idle / denominator if denominator else 0.0,
        "throughput_tok_s": tokens_window / busy_time if busy_time else 0.0,
        "balanced_bound_tok_s": (
            tokens_window / float((w * balanced_time[window]).sum()) if busy_time else 0.0
        ),
        "tpot_p50_ms": _percentile(tpot, 50, 1000.0),
        "tpot_p95_ms": _percentile(tpot, 95, 1000.0),
        "ttft_p95_ms": _percentile(ttft, 95, 1000.0),
        "pool_wait_p95_steps": _percentile(wait, 95),
        "starvation_guard_admissions": guard_admissions,
        "fallback_steps": fallback_steps,
        "drain_steps": drain_steps,
        "makespan_s": clock,
        "routing_steps": int(steps_in_window),
    }


def _safe_mean(weight: np.ndarray, values: np.ndarray, total_weight: float) -> float:
    return float((weight * values).sum() / total_weight) if total_weight else 0.0
