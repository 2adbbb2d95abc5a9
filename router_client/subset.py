"""Exact subset choice for Stage 2 with reachable-sum bitsets (the paper's Stage 2).

For a fixed worker, F depends on a subset ``Q`` only through ``D = sum of s_i over Q``. One
Python integer per subset size j is a bitset: bit b of ``dp[j]`` is set when exactly j of the
candidates sum to b (0/1 knapsack, ``dp[j] |= dp[j-1] << s`` with j descending).

F is concave in D, so its maximum over the reachable sums lies at the reachable sum nearest
its continuous peak from below or from above: two bit scans, whatever the number of
breakpoints (BR-0 has one, BR-H up to H+1). The subset is recovered by walking the prefix
tables backwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import ContractError


@dataclass(frozen=True, slots=True)
class SubsetChoice:
    """Indices into the candidate list, their total ``D`` and its score."""

    indices: tuple[int, ...]
    total: int
    score: float


def reachable_tables(sizes: Sequence[int], max_count: int,
                     limit: int | None = None) -> list[list[int]]:
    """``tables[i][j]``: bitset of sums of exactly j among the first i candidates (sums up to
    ``limit`` only, when given)."""
    mask = None if limit is None else (1 << (limit + 1)) - 1
    row = [1] + [0] * max_count
    tables = [row]
    for s in sizes:
        row = list(row)
        for j in range(max_count, 0, -1):
            row[j] |= row[j - 1] << s
            if mask is not None:
                row[j] &= mask
        tables.append(row)
    return tables


def _highest_at_most(bits: int, limit: int) -> int | None:
    if limit < 0:
        return None
    masked = bits & ((1 << (limit + 1)) - 1)
    return masked.bit_length() - 1 if masked else None


def _lowest_above(bits: int, limit: int) -> int | None:
    start = max(limit + 1, 0)
    shifted = bits >> start
    if not shifted:
        return None
    return start + (shifted & -shifted).bit_length() - 1


def _recover(tables: list[list[int]], sizes: Sequence[int], total: int, count: int) -> list[int]:
    chosen: list[int] = []
    for i in range(len(sizes), 0, -1):
        if (tables[i - 1][count] >> total) & 1:
            continue  # reachable without candidate i-1
        chosen.append(i - 1)
        total -= sizes[i - 1]
        count -= 1
    if total != 0 or count != 0:  # pragma: no cover - would mean a broken table
        raise ContractError("subset recovery failed")
    return sorted(chosen)


def best_subset(
    sizes: Sequence[int],
    max_count: int,
    score: Callable[[np.ndarray], np.ndarray],
    peak: float,
    truncate: bool = False,
    fill_slots: bool = False,
) -> SubsetChoice | None:
    """The non-empty subset of at most ``max_count`` candidates that maximizes a concave F.

    ``score`` maps an array of totals D to F; ``peak`` is where F stops increasing. Ties go to
    the smaller total (less risk of overflowing). Returns ``None`` if there is no candidate.

    ``fill_slots`` (finite ``peak``): the most requests whose total stays at or below the
    peak, the largest such total (BF-IO's rule: every free slot filled that can be without
    overflowing), where any subset stays there; otherwise the F-best subset as without it.

    ``truncate`` (finite ``peak``) keeps sums up to ``floor(peak) + max(sizes)`` only: the
    smallest reachable sum above the peak is never beyond that (drop any one member of a
    minimal such subset and the sum is at most the peak), and the bits below it are all the
    choice and the recovery read, so the answer is the same with far shorter bitsets.
    """
    max_count = min(max_count, len(sizes))
    if max_count <= 0:
        return None
    sizes = [int(s) for s in sizes]
    cap = (int(np.floor(peak)) + max(sizes) if truncate and np.isfinite(peak) and peak >= 0
           else None)
    tables = reachable_tables(sizes, max_count, cap)
    final = tables[-1]
    union = 0
    for j in range(1, max_count + 1):
        union |= final[j]
    limit = int(np.floor(peak)) if np.isfinite(peak) else union.bit_length()
    if fill_slots and np.isfinite(peak):
        for j in range(max_count, 0, -1):
            fitting = _highest_at_most(final[j], limit)
            if fitting is not None:
                value = float(score(np.asarray([fitting], dtype=np.float64))[0])
                return SubsetChoice(tuple(_recover(tables, sizes, fitting, j)), fitting, value)
    nearest = (_highest_at_most(union, limit), _lowest_above(union, limit))
    options = [t for t in nearest if t is not None]
    values = score(np.asarray(options, dtype=np.float64))
    best = min(range(len(options)), key=lambda k: (-float(values[k]), options[k]))
    total = options[best]
    # Most requests that reach the total: same D and F, but more tokens generated per step.
    count = next(j for j in range(max_count, 0, -1) if (final[j] >> total) & 1)
    return SubsetChoice(tuple(_recover(tables, sizes, total, count)), total, float(values[best]))
