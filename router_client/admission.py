"""BalanceRoute's two-stage admission: BR-0 and BR-H (arXiv 2605.06113).

One scheduling round, given the fleet view and the waiting pool (in arrival order):

Stage 1, while the free slots ``S_tot`` exceed ``s_greedy``, admits one request at a time:
  - ``stage1="paper"``: the worker with the most free slots (ties: lower load, then lower
    index) takes the single waiting request with the highest F.
  - ``stage1="best-pair"``: the (worker, request) pair with the highest F over all workers with
    free slots (ties: lower load, lower index, earlier request).
  - ``stage1="auto"`` (default): ``best-pair`` while the pool is short (no more waiting
    requests than free slots: every request is admitted this round, only *where* matters, and
    "most free slots" would act like JSQ), the paper's rule otherwise (saturation: *which*
    request fills a slot is what pays). The pool is short in that sense for the whole round,
    so Stage 2 is not needed then.
Stage 2, when ``S_tot <= s_greedy``: workers with free slots are taken in order of free slots,
then margin (most first); each takes the subset of the first ``r_max`` waiting requests, of
size at most its free slots, that maximizes F (:mod:`router_client.subset`).
Starvation guard: if the best F is not positive, the single best request is admitted anyway.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter
from typing import Literal

import numpy as np

from .errors import ContractError, ParameterError
from .fleet import Assignment, FleetView, WaitingRequest
from .fscore import MarginTable, discounts
from .projection import projected_loads
from .subset import best_subset

Stage1Rule = Literal["auto", "paper", "best-pair"]


@dataclass(frozen=True)
class BalanceRouteParams:
    """Parameters of BR-H; BR-0 is ``horizon=0`` (then ``alpha=1`` and ``beta=G`` are forced).

    Defaults follow the paper (arXiv 2605.06113): its deployment point (``H=80, beta=43,
    gamma=0.86``), ``R_max=4``, ``S_greedy=7`` and 1024 Stage-1 candidates from its
    predecessor simulator.
    They are a starting point for one hardware and model stack, not universal values.

    Attributes:
        horizon: ``H``, lookahead steps; 0 makes the policy BR-0.
        alpha: weight of the fill benefit.
        beta: weight of the overflow penalty; ``None`` means ``G`` (required for BR-0).
        gamma: per-step discount in (0, 1].
        r_max: Stage-2 candidates per worker (the first ``r_max`` of the pool).
        s_greedy: Stage 1 runs while the fleet's free slots exceed this.
        stage1_candidates: Stage 1 looks at the first this-many waiting requests.
        stage1: Stage-1 rule, see the module docstring.
    """

    horizon: int = 80
    alpha: float = 1.0
    beta: float | None = 43.0
    gamma: float = 0.86
    r_max: int = 4
    s_greedy: int = 7
    stage1_candidates: int = 1024
    stage1: Stage1Rule = "auto"

    def __post_init__(self) -> None:
        if self.horizon < 0:
            raise ParameterError("horizon", "must be >= 0")
        if self.horizon == 0 and self.alpha != 1.0:
            raise ParameterError("alpha", "BR-0 (horizon 0) forces alpha = 1")
        if self.alpha <= 0:
            raise ParameterError("alpha", "must be > 0")
        if self.beta is not None and self.beta < 0:
            raise ParameterError("beta", "must be >= 0")
        if not 0.0 < self.gamma <= 1.0:
            raise ParameterError("gamma", "must be in (0, 1]")
        if self.r_max < 1:
            raise ParameterError("r_max", "must be >= 1")
        if self.s_greedy < 0:
            raise ParameterError("s_greedy", "must be >= 0")
        if self.stage1_candidates < 1:
            raise ParameterError("stage1_candidates", "must be >= 1")
        if self.stage1 not in ("auto", "paper", "best-pair"):
            raise ParameterError("stage1", "must be one of auto, paper, best-pair")

    @classmethod
    def br0(cls, **overrides: object) -> BalanceRouteParams:
        """BR-0: no lookahead, ``alpha = 1``, ``beta = G`` (left unset: G is the fleet's)."""
        return cls(horizon=0, alpha=1.0, beta=None, **overrides)  # type: ignore[arg-type]

    def effective_beta(self, workers: int) -> float:
        """``beta``, or ``G`` when unset; in BR-0 (horizon 0) it cannot be anything but G."""
        if self.beta is None:
            return float(workers)
        if self.horizon == 0 and self.beta != workers:
            raise ParameterError(
                "beta", f"BR-0 (horizon 0) forces beta = G = {workers}, got {self.beta:g}"
            )
        return float(self.beta)

    def as_br0(self) -> BalanceRouteParams:
        """The BR-0 parameters this BR-H falls back to (same stage settings)."""
        return BalanceRouteParams.br0(
            r_max=self.r_max,
            s_greedy=self.s_greedy,
            stage1_candidates=self.stage1_candidates,
            stage1=self.stage1,
        )


@dataclass
class RoundStats:
    """What one round did (for metrics)."""

    stage1_admissions: int = 0
    stage2_admissions: int = 0
    starvation_guard_admissions: int = 0
    used_prediction: bool = False
    extra: dict[str, float] = field(default_factory=dict)


def build_table(fleet: FleetView, params: BalanceRouteParams) -> MarginTable:
    """Projection, envelope and margins for one round (H = 0: the current loads)."""
    beta = params.effective_beta(fleet.workers)
    if fleet.active_c_hat is None:
        if params.horizon > 0:
            raise ValueError("BR-H needs c_hat for every active request")
        loads = fleet.loads.astype(np.float64)[:, None]
        return MarginTable(loads, discounts(0, params.gamma), params.alpha, beta)
    loads = projected_loads(
        fleet.workers, params.horizon, fleet.active_worker, fleet.active_size, fleet.active_c_hat
    )
    return MarginTable(loads, discounts(params.horizon, params.gamma), params.alpha, beta)


def route_round(
    fleet: FleetView, pool: list[WaitingRequest], params: BalanceRouteParams
) -> tuple[list[Assignment], RoundStats]:
    """One scheduling round of BR-H (or BR-0 when ``params.horizon == 0``)."""
    started = perf_counter()
    stats = RoundStats(used_prediction=params.horizon > 0)
    free = fleet.free_slots.astype(np.int64).copy()
    total_free = int(free.sum())
    if not pool or total_free <= 0:
        return [], stats
    table = build_table(fleet, params)
    sizes = np.fromiter((r.prompt_tokens for r in pool), dtype=np.float64, count=len(pool))
    waiting = list(range(len(pool)))  # pool indices still waiting, in arrival order
    out: list[Assignment] = []

    def admit(worker: int, index: int, guard: bool = False) -> None:
        nonlocal total_free
        table.admit(worker, sizes[index])
        free[worker] -= 1
        total_free -= 1
        out.append(Assignment(index, worker, guard))

    rule = params.stage1
    short_pool = len(pool) <= total_free
    if rule == "best-pair" or (rule == "auto" and short_pool):
        threshold = 0 if (rule == "auto" and short_pool) else params.s_greedy
        while waiting and total_free > threshold:
            worker, pos = _best_pair(table, free, sizes, waiting[: params.stage1_candidates])
            admit(worker, waiting.pop(pos))
            stats.stage1_admissions += 1
    else:
        while waiting and total_free > params.s_greedy:
            loads0 = table.loads[:, 0]
            order = np.lexsort((np.arange(fleet.workers), loads0, -free))
            worker = int(order[0])
            candidates = waiting[: params.stage1_candidates]
            scores = table.score(worker, sizes[candidates])
            pos = int(np.argmax(scores))  # first maximum: the earliest request
            admit(worker, waiting.pop(pos))
            stats.stage1_admissions += 1

    stage2_started = perf_counter()
    stats.extra["stage1_s"] = stage2_started - started
    if waiting and total_free > 0:
        heap = [
            (-int(free[g]), -table.current_margin(g), g)
            for g in range(fleet.workers)
            if free[g] > 0
        ]
        heapq.heapify(heap)
        while heap and waiting:
            _, _, worker = heapq.heappop(heap)
            candidates = waiting[: params.r_max]
            choice = best_subset(
                [int(sizes[i]) for i in candidates],
                int(free[worker]),
                partial(table.score, worker),
                table.peak(worker),
            )
            if choice is None:
                continue
            if choice.score > 0:
                picked = [candidates[k] for k in choice.indices]
                for index in picked:
                    admit(worker, index)
                stats.stage2_admissions += len(picked)
            else:
                scores = table.score(worker, sizes[candidates])
                index = candidates[int(np.argmax(scores))]
                admit(worker, index, guard=True)
                stats.stage2_admissions += 1
                stats.starvation_guard_admissions += 1
                picked = [index]
            taken = set(picked)
            waiting = [i for i in waiting if i not in taken]
    stats.extra["stage2_s"] = perf_counter() - stage2_started
    return out, stats


def _best_pair(
    table: MarginTable, free: np.ndarray, sizes: np.ndarray, candidates: list[int]
) -> tuple[int, int]:
    """Highest-F (worker, position in ``candidates``); ties: lower load, index, earlier."""
    best: tuple[float, float, int, int] | None = None
    cand_sizes = sizes[candidates]
    for worker in np.flatnonzero(free > 0):
        scores = table.score(int(worker), cand_sizes)
        pos = int(np.argmax(scores))
        key = (-float(scores[pos]), float(table.loads[worker, 0]), int(worker), pos)
        if best is None or key < best:
            best = key
    if best is None:
        raise ContractError("best pair asked with no worker that has a free slot")
    return best[2], best[3]
