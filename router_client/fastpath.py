"""BR-0's Stage 1 without a pass over the pool per admission (the fast path).

At ``H = 0`` a worker's score is ``F(D) = D - G * max(0, D - m)`` with ``m`` its margin: it
rises with slope 1 up to ``m`` and falls with slope ``1 - G`` after (G > 1). Its maximum over
the candidates is therefore at one of two sizes: the largest ``D <= m`` or the smallest
``D > m``. With the Stage-1 window kept sorted by ``(size, pool index)`` both are a binary
search away, and the earliest request of a size is the first entry of its run, which is the
reference's tie rule (``argmax``: the first maximum in arrival order).

- ``paper`` rule: the worker with the most free slots (ties: lower load, lower index) comes
  off a heap keyed exactly like the reference's ``lexsort``; only the admitting worker's key
  changes, so it is pushed back and nothing else moves.
- ``lpt`` rule (a short pool): the window's largest request onto the open worker with the
  lowest key (``load + weight * active requests``), from a heap of the open workers.
- ``best-pair`` rule: every open worker's best request is found at once with
  ``numpy.searchsorted`` over the sorted window (vectorized across workers), then the pair is
  chosen with the reference's key ``(-F, load, worker, request)``.

The arithmetic is the reference's (:meth:`router_client.fscore.MarginTable.score` at H = 0:
``F = D`` below the margin, ``D - G * (D - m)`` above), in float64 on integer-valued loads and
sizes, so every comparison, ties included, comes out the same. The path applies only where
that holds (:func:`applies`); anything else (BR-H, G = 1, non-integer loads) runs the
reference's stages. Stage 2 (:func:`stage2_br0`) is the reference's loop on scalar state
(Python ints and floats); the subset choice itself is the exact bitset search of
:mod:`router_client.subset` in every case.

Every fast round, BR-H's included, reads only the head of the pool it can reach
(:func:`router_client.admission.reachable_head`), and BR-H's exhaustive Stage-2 subset choice
sums all subsets at once (:func:`best_row_subset`).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, combinations, islice

import numpy as np

from .subset import SubsetChoice, best_subset

EXACT_LIMIT = float(2**40)  # integer-valued floats below this add and multiply by G exactly


def applies(horizon: int, rows: object, loads: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether the fast path reproduces the reference exactly for this round."""
    if horizon != 0 or rows is not None or loads.shape[0] < 2:
        return False
    for values in (loads, sizes):
        if values.size and not (np.abs(values).max() < EXACT_LIMIT
                                and (values == np.floor(values)).all()):
            return False
    return True


@dataclass
class Window:
    """The first ``limit`` still-waiting requests, sorted by ``(size, pool index)``.

    Requests only leave (admitted); each departure lets the next waiting request in, as the
    reference's ``waiting[:limit]`` does. The order is kept as two parallel lists (sizes and
    pool indices), so building it is two ``tolist`` calls, not a tuple per request.
    """

    sizes: np.ndarray
    order: list[int]  # every waiting pool index (or a head of them), arrival order
    limit: int
    key_size: list[float] = field(default_factory=list)
    key_index: list[int] = field(default_factory=list)
    next_in: int = 0
    taken: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.next_in = min(self.limit, len(self.order))
        head = np.asarray(self.order[: self.next_in], dtype=np.int64)
        sizes = self.sizes[head]
        ranked = np.lexsort((head, sizes))
        self.key_size = sizes[ranked].tolist()
        self.key_index = head[ranked].tolist()

    def __len__(self) -> int:
        return len(self.key_size)

    def best(self, margin: float, beta: float) -> tuple[float, int]:
        """``(F, pool index)`` of the best request for a worker with this margin."""
        key_size = self.key_size
        j = bisect_right(key_size, margin)  # first size above the margin
        best: tuple[float, int] | None = None
        if j > 0:
            size = key_size[j - 1]
            best = (size, self.key_index[bisect_left(key_size, size)])
        if j < len(key_size):
            size = key_size[j]
            high = (size - beta * (size - margin), self.key_index[j])
            if best is None or (high[0], -high[1]) > (best[0], -best[1]):
                best = high
        if best is None:
            raise IndexError("best request asked of an empty window")
        return best

    def _position(self, size: float, index: int) -> int:
        low = bisect_left(self.key_size, size)
        return bisect_left(self.key_index, index, low, bisect_right(self.key_size, size, low))

    def remove(self, size: float, index: int) -> tuple[int, int | None]:
        """Take a request out; returns where it was and where the request that entered in
        its place went (``None``: none left to enter)."""
        gone = self._position(size, index)
        del self.key_size[gone], self.key_index[gone]
        self.taken.add(index)
        if self.next_in >= len(self.order):
            return gone, None
        entering = self.order[self.next_in]
        self.next_in += 1
        size = float(self.sizes[entering])
        came = self._position(size, entering)
        self.key_size.insert(came, size)
        self.key_index.insert(came, entering)
        return gone, came

    def still_waiting(self, need: int | None = None) -> list[int]:
        """The pool indices still waiting, arrival order (only the first ``need``, if given)."""
        head = self.next_in  # everything taken entered the window, which is a prefix
        if need is None:
            return [i for i in self.order[:head] if i not in self.taken] + self.order[head:]
        return list(islice((i for i in self.order if i not in self.taken), need))


@dataclass
class Stage1Result:
    """What the fast Stage 1 did: admissions ``(pool index, worker)`` and the new loads (who
    still waits: the window's :meth:`Window.still_waiting`)."""

    admitted: list[tuple[int, int]]
    loads: np.ndarray
    free: np.ndarray


def stage1_paper(loads: np.ndarray, free: np.ndarray, window: Window, beta: float,
                 threshold: int) -> Stage1Result:
    """The paper's rule while the free slots exceed ``threshold``."""
    load = loads.astype(np.float64).tolist()
    slots = free.astype(np.int64).tolist()
    envelope = max(load)
    total = sum(slots)
    # Only workers with a free slot can come off the top while some slot is free (threshold
    # >= 0), so the heap holds just those: at saturation a few of G.
    heap = [(-slots[g], load[g], g) for g in np.flatnonzero(free > 0).tolist()]
    heapq.heapify(heap)
    admitted: list[tuple[int, int]] = []
    while len(window) and total > threshold:
        _, _, worker = heapq.heappop(heap)
        _, index = window.best(envelope - load[worker], beta)
        size = float(window.sizes[index])
        window.remove(size, index)
        load[worker] += size
        envelope = max(envelope, load[worker])
        slots[worker] -= 1
        total -= 1
        admitted.append((index, worker))
        heapq.heappush(heap, (-slots[worker], load[worker], worker))
    return Stage1Result(admitted, np.asarray(load), np.asarray(slots, dtype=np.int64))


def stage1_lpt(loads: np.ndarray, free: np.ndarray, window: Window, capacity: int,
               weight: float) -> Stage1Result:
    """The ``lpt`` rule on a short pool: the window's largest request (the earliest of its
    size: the first entry of the last run) onto the open worker with the lowest ``load +
    weight * active requests`` (ties: lower index), from a heap of the open workers, until
    every request or every slot is used."""
    load = loads.astype(np.float64).tolist()
    slots = free.astype(np.int64).tolist()
    heap = [(load[g] + weight * (capacity - slots[g]), g)
            for g in np.flatnonzero(free > 0).tolist()]
    heapq.heapify(heap)
    admitted: list[tuple[int, int]] = []
    while len(window) and heap:
        _, worker = heapq.heappop(heap)
        size = window.key_size[-1]
        index = window.key_index[bisect_left(window.key_size, size)]
        window.remove(size, index)
        load[worker] += size
        slots[worker] -= 1
        admitted.append((index, worker))
        if slots[worker] > 0:
            heapq.heappush(heap, (load[worker] + weight * (capacity - slots[worker]), worker))
    return Stage1Result(admitted, np.asarray(load), np.asarray(slots, dtype=np.int64))


def stage1_best_pair(loads: np.ndarray, free: np.ndarray, window: Window, beta: float,
                     threshold: int) -> Stage1Result:
    """The best-pair rule while the free slots exceed ``threshold``, workers in one pass."""
    load = loads.astype(np.float64).copy()
    slots = free.astype(np.int64).copy()
    total = int(slots.sum())
    # The window as arrays, edited in place in step with its lists (no rebuild per admission)
    sizes = np.array(window.key_size, dtype=np.float64)
    indices = np.array(window.key_index, dtype=np.int64)
    open_workers = np.flatnonzero(slots > 0)
    admitted: list[tuple[int, int]] = []
    while len(window) and total > threshold:
        n = len(window)
        score, index = best_per_worker(sizes[:n], indices[:n], load.max() - load[open_workers],
                                       beta)
        pick = np.lexsort((index, open_workers, load[open_workers], -score))[0]
        worker, chosen = int(open_workers[pick]), int(index[pick])
        size = float(window.sizes[chosen])
        gone, came = window.remove(size, chosen)
        sizes[gone:n - 1], indices[gone:n - 1] = sizes[gone + 1:n], indices[gone + 1:n]
        if came is not None:  # the window keeps its length: shift right from `came`
            sizes[came + 1:n], indices[came + 1:n] = sizes[came:n - 1], indices[came:n - 1]
            sizes[came], indices[came] = window.key_size[came], window.key_index[came]
        load[worker] += size
        slots[worker] -= 1
        total -= 1
        if slots[worker] <= 0:
            open_workers = open_workers[open_workers != worker]
        admitted.append((chosen, worker))
    return Stage1Result(admitted, load, slots)


def best_per_worker(sizes: np.ndarray, indices: np.ndarray, margins: np.ndarray, beta: float
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Each margin's best ``(F, pool index)`` over a window sorted by ``(size, index)``."""
    n = sizes.size
    j = np.searchsorted(sizes, margins, side="right")  # first size above the margin
    has_low, has_high = j > 0, j < n
    low_size = sizes[np.maximum(j - 1, 0)]
    low_pos = np.searchsorted(sizes, low_size, side="left")  # earliest of that size
    low_score = np.where(has_low, low_size, -np.inf)
    low_index = indices[low_pos]
    high_size = sizes[np.minimum(j, n - 1)]
    high_score = np.where(has_high, high_size - beta * (high_size - margins), -np.inf)
    high_index = indices[np.minimum(j, n - 1)]
    take_high = (high_score > low_score) | ((high_score == low_score) & (high_index < low_index))
    return (np.where(take_high, high_score, low_score),
            np.where(take_high, high_index, low_index))


def br0_scores(totals: np.ndarray, margin: float, beta: float) -> np.ndarray:
    """:meth:`MarginTable.score` at H = 0 with the same arithmetic: ``D`` up to the margin,
    ``D - beta * (D - m)`` above it."""
    totals = np.asarray(totals, dtype=np.float64)
    return np.where(totals > margin, totals - beta * (totals - margin), totals)


@dataclass
class Stage2Result:
    """Stage 2's admissions ``(pool index, worker, starvation guard)`` and the waiting list."""

    admitted: list[tuple[int, int, bool]]
    waiting: list[int]
    waited: list[int] = field(default_factory=list)  # workers the guard idle held back
    patience_admissions: int = 0  # guard admissions of workers out of patience
    revisit_admissions: int = 0  # admissions on a revisit (``revisit``)


def stage2_br0(loads: np.ndarray, free: np.ndarray, sizes: np.ndarray, waiting: list[int],
               r_max: int, beta: float, order_by: str = "slots",
               fill_slots: bool = False, guard: str = "always",
               wait: WaitContext | None = None, revisit: bool = False) -> Stage2Result:
    """The reference's Stage 2 at H = 0 on scalar state: workers by (most free slots, widest
    margin, index) (``order_by="slots"``) or by (widest margin, index) (``"margin"``), each
    the exact best subset of the first ``r_max`` waiting requests
    (:func:`router_client.subset.best_subset`, peak at the margin; ``fill_slots`` as there),
    starvation guard alike (``guard="idle"``, which needs ``wait``: where it applies this
    round, see ``admission._Round._guard_waits``, a worker whose best subset scores F <= 0
    takes nothing where no candidate's overflow pays, :func:`overflow_pays`; a worker with no
    request, all ``wait.capacity`` slots free, never waits, nor does one in
    ``wait.impatient``). ``revisit``: a worker that took a subset scoring F > 0 and has
    slots left is taken again after every worker's first visit (later admissions may have
    raised the maximum, and the window has moved on), revisits in the same order by their
    slots and margins under the round's first maximum; a revisit admits only a subset
    scoring F > 0 (no guard)."""
    if guard not in ("always", "idle"):
        raise ValueError(f"guard must be 'always' or 'idle', not {guard!r}")
    if guard == "idle" and wait is None:
        raise ValueError("guard 'idle' needs its WaitContext")
    load = loads.astype(np.float64).tolist()
    envelope = max(load)
    slots = free.tolist()
    by_slots = order_by == "slots"
    # (revisit, slots, margin under the round's first maximum, index): first visits in
    # the order's sorted order, then revisits, each keyed by its margin under that same
    # maximum (its load: nothing changes it until it is popped again)
    first = envelope
    order = [(False, -slots[g] if by_slots else 0, -(first - load[g]), g)
             for g in np.flatnonzero(free > 0).tolist()]
    heapq.heapify(order)
    admitted: list[tuple[int, int, bool]] = []
    waited: list[int] = []
    patience_admissions = revisit_admissions = 0
    while order and waiting:
        again, _, _, worker = heapq.heappop(order)
        candidates = waiting[:r_max]
        margin = envelope - load[worker]
        score = partial(br0_scores, margin=margin, beta=beta)
        totals = sizes[candidates].astype(np.int64).tolist()
        if min(slots[worker], len(candidates)) == 1:
            choice: SubsetChoice | None = best_single(totals, margin, beta, fill_slots)
        else:
            choice = best_subset(totals, slots[worker], score, margin, truncate=True,
                                 fill_slots=fill_slots)
        if choice is None:
            continue
        if choice.score > 0:
            picked = [candidates[k] for k in choice.indices]
            forced = False
            revisit_admissions += len(picked) if again else 0
        elif again:
            continue  # a revisit admits only what pays
        else:
            # the guard idle holds the worker back where no candidate's overflow pays (a
            # worker with no request never waits), unless it is out of patience
            holds = (guard == "idle" and wait is not None and slots[worker] < wait.capacity
                     and not bool(overflow_pays(sizes[candidates], margin, wait.workers,
                                                wait.active + len(admitted),
                                                wait.overhead).any()))
            if holds and wait is not None and worker not in wait.impatient:
                waited.append(worker)
                continue
            patience_admissions += holds
            # starvation guard: the single best request, even at F <= 0
            picked = [candidates[int(np.argmax(score(sizes[candidates])))]]
            forced = True
        for index in picked:
            load[worker] += float(sizes[index])
            envelope = max(envelope, load[worker])
            admitted.append((index, worker, forced))
        slots[worker] -= len(picked)
        if revisit and not forced and slots[worker] > 0:
            heapq.heappush(order, (True, -slots[worker] if by_slots else 0,
                                   -(first - load[worker]), worker))
        taken = set(picked)
        waiting = [i for i in candidates if i not in taken] + waiting[len(candidates):]
    return Stage2Result(admitted, waiting, waited, patience_admissions, revisit_admissions)


@dataclass(frozen=True)
class WaitContext:
    """What the guard ``idle`` weighs besides the candidates: ``capacity`` (B: a worker with
    all B slots free never waits), ``workers`` (G, the workers up), ``active`` (N, the
    requests running on them, with the round's admissions before :func:`stage2_br0`),
    ``overhead`` (``K = b / a`` of the step time ``a M + b``, in KV tokens) and
    ``impatient`` (workers that have waited ``patience`` rounds in a row: they do not wait)."""

    capacity: int
    workers: int
    active: int
    overhead: float
    impatient: frozenset[int] = frozenset()


def overflow_pays(sizes: np.ndarray, margin: float, workers: int, active: int,
                  overhead: float) -> np.ndarray:
    """For each candidate of ``sizes``, whether admitting it to a worker with ``margin`` pays
    though it may overflow (the guard ``idle`` leaves the worker's slots empty where it pays
    for none; ``admission._Round._wait``): BR-0's F at step 0, ``s - G max(0, s - m)``, plus
    the admission's share of the step's fixed cost, ``G overhead / N`` (``overhead = b / a``
    in KV tokens, ``N`` active requests), is positive.

    From the throughput of a step, ``N / (a M + b)``: one more request raises it though it
    overflows the maximum ``M`` by ``o`` where ``N o < M + b / a``; with ``M`` about
    ``N s / G`` that is ``s - G o + G (b / a) / N > 0``. Where a step's cost is mostly fixed
    (few requests, or a large ``b``), a slot is worth an overflow; where ``b / a`` is 0 this
    is BR-0's F now. (The same inequality with the actual ``M``, this step's exact answer,
    was measured and not kept: it admits small requests' overflows that last their whole
    life; see the README.)"""
    over = np.maximum(0.0, sizes - margin)
    share = workers * overhead / max(active, 1) if overhead > 0 else 0.0
    return sizes - workers * over + share > 0


def best_single(totals: list[int], margin: float, beta: float,
                fill_slots: bool = False) -> SubsetChoice:
    """:func:`router_client.subset.best_subset` with room for one request, without bitsets:
    the largest size up to ``floor(margin)`` or the smallest above it, the higher F (ties: the
    smaller size), the earliest candidate of that size (what its recovery returns);
    ``fill_slots``: the largest size up to ``floor(margin)`` wherever there is one."""
    limit = math.floor(margin)
    below = [t for t in totals if t <= limit]
    above = [t for t in totals if t > limit]
    if fill_slots and below:
        above = []
    options = ([max(below)] if below else []) + ([min(above)] if above else [])
    values = [br0_score_scalar(float(t), margin, beta) for t in options]
    best = min(range(len(options)), key=lambda k: (-values[k], options[k]))
    total = options[best]
    return SubsetChoice((totals.index(total),), total, values[best])


def br0_score_scalar(total: float, margin: float, beta: float) -> float:
    """:func:`br0_scores` for one total, in Python floats (the same IEEE operations)."""
    return total - beta * (total - margin) if total > margin else total


def best_row_subset(rows: np.ndarray, max_count: int,
                    score: Callable[[np.ndarray], np.ndarray],
                    fit_margin: float | None = None) -> SubsetChoice:
    """BR-H's exhaustive Stage-2 choice (``admission._best_row_subset`` while it enumerates)
    with every subset's summed rows computed in one fancy-indexed ``sum`` per subset size
    instead of one per subset: the same subsets in the same order, each summed by numpy's
    same reduction over its member rows (bit for bit, tested), the same ``score`` call on the
    stacked sums, and its tie rule (``-F``, then the added work now, then more requests; the
    first such subset) by a stable ``lexsort``. ``fit_margin``: as the reference's."""
    n = rows.shape[0]
    members: list[np.ndarray] = []
    for j in range(1, max_count + 1):
        flat = np.fromiter(chain.from_iterable(combinations(range(n), j)), dtype=np.int64)
        members.append(flat.reshape(-1, j))
    sums = np.concatenate([rows[m].sum(axis=1) for m in members])
    counts = np.concatenate([np.full(len(m), m.shape[1]) for m in members])
    values = score(sums)
    fits = sums[:, 0] <= fit_margin if fit_margin is not None else None
    if fits is not None and fits.any():  # the most requests that fit now, then the best F
        order = np.lexsort((sums[:, 0], -values, -counts, ~fits))
        best = int(order[0])
    else:
        best = int(np.lexsort((-counts, sums[:, 0], -values))[0])
    j = int(counts[best])
    subset = members[j - 1][best - int(np.searchsorted(counts, j))]
    return SubsetChoice(tuple(subset.tolist()), int(round(sums[best, 0])),
                        float(values[best]))
