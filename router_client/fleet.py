"""What a policy sees of the fleet at the start of a scheduling round.

The view is a snapshot: policies read it and return assignments; they never mutate it. The
simulator and the mirrored state of a serving proxy both build it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Default step-time model: about 0.15 us per KV token and 10 ms fixed per step. With the
# paper's deployment (G = 8, B = 64, contexts of 4-5k tokens) the most loaded worker reads
# about 300k KV tokens, which gives 45 ms + 10 ms: close to the ~60 ms decode step the paper
# reports, and bandwidth-dominated as it observed at typical load.
DEFAULT_STEP_COST = (1.5e-7, 0.010)


@dataclass(frozen=True, slots=True)
class WaitingRequest:
    """A prefilled request in the waiting pool.

    ``prompt_tokens`` is ``s_i``: the KV tokens the request adds to a worker's load when it is
    admitted (its first decode step reads the whole prompt).
    """

    request_id: int | str
    prompt_tokens: int
    arrival_step: int = 0
    prompt_key: str | None = None


@dataclass(frozen=True, slots=True)
class Assignment:
    """Route pool entry ``pool_index`` (its position in the pool passed to the policy)."""

    pool_index: int
    worker: int
    starvation_guard: bool = False


@dataclass(frozen=True)
class FleetView:
    """The fleet at the start of a round.

    Attributes:
        capacity: ``B``, the most active requests one worker may hold.
        loads: ``L_g``, KV tokens each worker reads at its next step (sum of ``s_i + a_i``).
        active_counts: active requests per worker.
        active_worker: for each active request, the worker that holds it.
        active_size: for each active request, ``s_i + a_i`` (its work at the next step).
        active_c_hat: for each active request, the expected capped remaining life ``c_hat``
            in steps (fractional allowed), or ``None`` when no prediction is available; BR-H
            then routes as BR-0.
        pool_c_hat: for each waiting request of the pool passed with this view (same order),
            its predicted capped life ``c_hat`` once admitted (NaN: not predicted yet), or
            ``None``. BR-H projects a candidate's own added load with it; unknown means H.
        active_p_fin, active_mu_rem: for each active request, the probability of ending
            within H and the mean remaining if it does, when the predictor gives them; BR-H
            then projects the expected load under that two-point law instead of a
            deterministic end at ``c_hat``.
        step_overhead: ``b / a`` of the fleet's step time ``a max_g L_g + b``, in KV tokens,
            where known (the simulator's step-cost model); the guard ``idle`` weighs an
            overflow against it (``BalanceRouteParams.step_overhead`` overrides it).
        down: for each worker, whether it is down and shown as full (the proxy's rank mask),
            or ``None`` (all up); the guard ``idle`` counts neither such a worker nor its
            requests.
    """

    capacity: int
    loads: np.ndarray
    active_counts: np.ndarray
    active_worker: np.ndarray
    active_size: np.ndarray
    active_c_hat: np.ndarray | None = None
    pool_c_hat: np.ndarray | None = None
    active_p_fin: np.ndarray | None = None
    active_mu_rem: np.ndarray | None = None
    arrival_rate: float | None = None
    step_overhead: float | None = None
    down: np.ndarray | None = None

    @property
    def has_law(self) -> bool:
        """Whether the active requests come with a learned law (``p_fin`` and ``mu_rem``)."""
        return self.active_p_fin is not None and self.active_mu_rem is not None

    @property
    def workers(self) -> int:
        return int(self.loads.shape[0])

    @property
    def live_workers(self) -> int:
        """Workers that are not down."""
        return self.workers - (0 if self.down is None else int(np.count_nonzero(self.down)))

    @property
    def live_active(self) -> int:
        """Active requests on workers that are not down."""
        if self.down is None:
            return int(self.active_counts.sum())
        return int(self.active_counts[~np.asarray(self.down, dtype=bool)].sum())

    @property
    def free_slots(self) -> np.ndarray:
        return self.capacity - self.active_counts

    @classmethod
    def from_active(
        cls,
        workers: int,
        capacity: int,
        active_worker: np.ndarray,
        active_size: np.ndarray,
        active_c_hat: np.ndarray | None = None,
    ) -> FleetView:
        """Build a view from per-request arrays (loads and counts are derived)."""
        active_worker = np.asarray(active_worker, dtype=np.int64)
        active_size = np.asarray(active_size, dtype=np.float64)
        loads = np.bincount(active_worker, weights=active_size, minlength=workers)
        counts = np.bincount(active_worker, minlength=workers).astype(np.int64)
        return cls(capacity, loads, counts, active_worker, active_size, active_c_hat)


class ArrivalRate:
    """Requests entering the waiting pool per step: an exponentially weighted average over
    about ``memory`` steps, normalised by the weight seen so far (so it is the plain mean
    of the steps seen while fewer than that have passed, and not biased toward 0 at start).

    Call :meth:`add` once per step with that step's arrivals (``steps`` > 1 for a stretch of
    steps that all had this many in total, such as an idle stretch with none)."""

    def __init__(self, memory: float = 50.0) -> None:
        if not memory >= 1:
            raise ValueError("memory must be >= 1 step")
        self.decay = 1.0 - 1.0 / memory
        self._sum = 0.0
        self._weight = 0.0

    def add(self, arrivals: int, steps: int = 1) -> None:
        fade = self.decay ** steps
        self._sum = fade * self._sum + arrivals
        self._weight = fade * self._weight + (1.0 - fade) / (1.0 - self.decay)

    @property
    def rate(self) -> float | None:
        """Arrivals per step, or ``None`` before the first step."""
        return self._sum / self._weight if self._weight > 0 else None
