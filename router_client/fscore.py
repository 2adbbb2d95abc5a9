"""The F-score of BR-0 and BR-H.

BR-H over the margins ``m_{g,h}`` (h = 0..H) of one worker, with discounts ``d_h = gamma^h``::

    F(D) = alpha * (sum_h d_h) * D  -  beta * sum_h d_h * max(0, D - m_h)

BR-0 is ``H = 0, alpha = 1, beta = G``: ``F(D) = D - G * max(0, D - m)``.

Scale: each step's term ``d_h * (alpha * D - beta * max(0, D - m_h))`` is BR-0's score at step h
when ``beta / alpha = G``: the discounted sum of the one-step imbalance reductions. That is
the default (``beta = alpha * G``); the paper's deployment value 43 (with alpha = 1, G = 8)
penalizes a token of overflow 5.4 times more than it costs, and loses to BR-0 on short
outputs in our simulator.

Candidate rows: a request does not add a constant ``D`` over the window. Admitted now, it
reads ``s + h`` KV tokens at step h while it runs and nothing after it ends, so its added
work is a row ``w_h = (s + h) * alive_h`` (alive from its own ``c_hat``, as in the projection).
:meth:`MarginTable.score_rows` and :meth:`MarginTable.admit_row` score and admit such rows
(``O(H)`` each); :meth:`MarginTable.score` keeps the paper's constant-``D`` fast path.

:class:`MarginTable` keeps every worker's margins sorted with prefix sums of ``d`` and
``d * m`` in that order, so one evaluation is a binary search (``O(log H)``). ``F`` is concave
in ``D`` (a linear term minus a sum of hinge functions), which subset selection relies on.
"""

from __future__ import annotations

import numpy as np
from scipy.special import ndtr


def br0_score(D: float | np.ndarray, margin: float, workers: int) -> float | np.ndarray:
    """BR-0's ``F = D - G * max(0, D - m)`` (the paper's BR-0)."""
    return D - workers * np.maximum(0.0, np.asarray(D, dtype=np.float64) - margin)


def candidate_rows(
    sizes: np.ndarray, c_hat: np.ndarray | None, horizon: int, refill: float | None = None
) -> np.ndarray:
    """Added work ``w_h = (s + h) * alive_h`` of each candidate, shape ``(n, H+1)``.

    ``alive_h = clip(c - h, 0, 1)`` as in :func:`router_client.projection.projected_loads`,
    with ``c`` clipped to ``[1, H]``; ``c = H`` ("at least H") or unknown (NaN, ``None``) means
    alive over the whole window.
    """
    sizes = np.asarray(sizes, dtype=np.float64)
    steps = np.arange(horizon + 1, dtype=np.float64)
    rows = sizes[:, None] + steps[None, :]
    if c_hat is None or horizon == 0:
        return rows
    c = np.asarray(c_hat, dtype=np.float64)
    c = np.clip(np.where(np.isfinite(c), c, float(horizon)), 1.0, float(horizon))
    alive = np.clip(c[:, None] - steps[None, :], 0.0, 1.0)
    alive[c >= horizon] = 1.0
    out = rows * alive
    if refill is not None:  # the emptied slot is taken at once by a request of that size
        ended = np.where(c >= horizon, float(horizon + 1), np.floor(c))
        after = steps[None, :] - ended[:, None]
        out += np.where(after >= 0, refill + after, 0.0) * (1.0 - alive)
    return out


def discounts(horizon: int, gamma: float) -> np.ndarray:
    """``d = (1, gamma, ..., gamma^H)``."""
    return gamma ** np.arange(horizon + 1, dtype=np.float64)


def direct_score(
    D: float | np.ndarray, margins: np.ndarray, d: np.ndarray, alpha: float, beta: float
) -> np.ndarray:
    """F by the O(H) definition; the reference the fast path is tested against."""
    D = np.asarray(D, dtype=np.float64)
    over = np.maximum(0.0, D[..., None] - margins)
    return alpha * d.sum() * D - beta * (over * d).sum(axis=-1)


def expected_overflow(x: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """``E[max(0, x + e)]`` for ``e ~ Normal(0, sigma^2)``: ``x Phi(x/sigma) + sigma
    phi(x/sigma)``, and ``max(0, x)`` where ``sigma`` is 0. Convex and increasing in ``x``,
    above ``max(0, x)``, and nearly flat in ``x`` where ``sigma`` is large. ``sigma`` is a
    scalar or runs along the last axis of ``x`` (one value per horizon step); only its
    positive columns are evaluated."""
    x = np.asarray(x, dtype=np.float64)
    shape = x.shape
    x = np.atleast_1d(x)
    sigma = np.broadcast_to(np.asarray(sigma, dtype=np.float64), x.shape[-1:])
    out = np.maximum(0.0, x)
    cols = np.flatnonzero(sigma > 0.0)
    part, scale = x[..., cols], sigma[cols]
    z = part / scale
    out[..., cols] = part * ndtr(z) + scale * np.exp(-0.5 * z * z) * _INV_SQRT_2PI
    return out.reshape(shape)


_INV_SQRT_2PI = 1.0 / np.sqrt(2.0 * np.pi)


class MarginTable:
    """Per-worker projected loads, the envelope and sorted margins for fast F evaluation.

    ``loads`` has shape ``(G, H+1)``: worker g's projected load h steps ahead. Admitting
    ``D`` tokens to a worker adds ``D`` to its whole row and raises the envelope where needed;
    a worker's sorted margins are rebuilt lazily, only when it is next scored.
    """

    def __init__(self, loads: np.ndarray, d: np.ndarray, alpha: float, beta: float,
                 spread: np.ndarray | None = None, marginal: bool = False) -> None:
        self.loads = np.array(loads, dtype=np.float64, copy=True)
        if self.loads.ndim != 2 or self.loads.shape[1] != d.shape[0]:
            raise ValueError("loads must have shape (G, H+1) matching the discounts")
        if spread is not None and np.shape(spread) != self.loads.shape:
            raise ValueError("spread must have the shape of loads")
        # Standard deviation of each projected load (None: the loads are known): the
        # penalty is then the expected overflow, see score_rows.
        self.spread = None if spread is None or not np.any(spread) else np.asarray(spread)
        # With a spread, ``marginal`` scores the rise of the expected overflow the added work
        # causes, E[max(0, w + e - m)] - E[max(0, e - m)], instead of E[max(0, w + e - m)]
        # (which charges a worker near the envelope for its own uncertainty, whatever it
        # takes): see score_rows.
        self.marginal = marginal
        self.d = d
        self.alpha = alpha
        self.beta = beta
        self.fill = alpha * float(d.sum())
        self.envelope = self.loads.max(axis=0)
        workers, width = self.loads.shape
        self._sorted = np.zeros((workers, width))
        self._cum_d = np.zeros((workers, width + 1))
        self._cum_dm = np.zeros((workers, width + 1))
        # Rows whose sorted margins are out of date; rebuilt lazily, only when scored.
        self._stale = np.ones(workers, dtype=bool)

    @property
    def workers(self) -> int:
        return int(self.loads.shape[0])

    def _refresh(self, rows: np.ndarray | slice) -> None:
        margins = self.envelope[None, :] - self.loads[rows]
        order = np.argsort(margins, axis=1, kind="stable")
        ordered = np.take_along_axis(margins, order, axis=1)
        d_sorted = self.d[order]
        self._sorted[rows] = ordered
        self._cum_d[rows, 1:] = np.cumsum(d_sorted, axis=1)
        self._cum_dm[rows, 1:] = np.cumsum(d_sorted * ordered, axis=1)
        self._stale[rows] = False

    def _ensure(self, worker: int) -> None:
        if self._stale[worker]:
            self._refresh(np.array([worker]))

    def margins(self, worker: int) -> np.ndarray:
        """Worker's margins ``M_h - L_{g,h}`` in horizon order."""
        return self.envelope - self.loads[worker]

    def current_margin(self, worker: int) -> float:
        return float(self.envelope[0] - self.loads[worker, 0])

    def score(self, worker: int, D: float | np.ndarray) -> np.ndarray:
        """F for admitting ``D`` tokens (scalar or array) to ``worker``; O(log H) each (with a
        spread: ``D`` at every step through :meth:`score_rows`, O(H))."""
        D = np.asarray(D, dtype=np.float64)
        if self.spread is not None:
            return self.score_rows(worker, np.repeat(D[..., None], self.d.shape[0], axis=-1))
        self._ensure(worker)
        k = np.searchsorted(self._sorted[worker], D, side="left")  # margins strictly below D
        cum_d = self._cum_d[worker]
        cum_dm = self._cum_dm[worker]
        return self.fill * D - self.beta * (D * cum_d[k] - cum_dm[k])

    def peak(self, worker: int) -> float:
        """The ``D`` at which F stops increasing (``inf`` if it never does).

        On the segment after the k smallest margins the slope is
        ``alpha * sum(d) - beta * cum_d[k]``; F peaks at the first margin past which the slope
        is no longer positive. Not defined with a spread (F is then smooth).
        """
        if self.spread is not None:
            raise ValueError("the peak is for known loads; with a spread, score rows")
        self._ensure(worker)
        slopes = self.fill - self.beta * self._cum_d[worker][1:]
        nonpositive = np.flatnonzero(slopes <= 0.0)
        if nonpositive.size == 0:
            return float("inf")
        return float(self._sorted[worker][nonpositive[0]])

    def score_rows(self, worker: int, rows: np.ndarray) -> np.ndarray:
        """F for added work given per step (``rows`` of shape ``(..., H+1)``); ``O(H)`` each::

            F = alpha * sum_h d_h * w_h  -  beta * sum_h d_h * max(0, w_h - m_h)

        With a spread the overflow is its expectation, ``E[max(0, w_h + e - m_h)]`` with
        ``e`` normal of the worker's spread at step h, less ``E[max(0, e - m_h)]`` where
        ``marginal``."""
        rows = np.asarray(rows, dtype=np.float64)
        margins = self.envelope - self.loads[worker]
        if self.spread is None:
            over = np.maximum(0.0, rows - margins)
        else:
            over = expected_overflow(rows - margins, self.spread[worker])
            if self.marginal:  # the worker's own expected overflow, without the added work
                over = over - expected_overflow(-margins, self.spread[worker])
        return self.alpha * (rows @ self.d) - self.beta * (over @ self.d)

    def score_row_workers(self, workers: np.ndarray, row: np.ndarray) -> np.ndarray:
        """:meth:`score_rows` of one row of added work on each of ``workers`` at once (the
        same terms, to rounding). Each worker's penalty is reduced by the same row-wise sum,
        so workers in the same state score exactly alike and the caller's tie rule decides
        between them (a matrix product may round identical rows differently)."""
        row = np.asarray(row, dtype=np.float64)
        if self.spread is not None:  # a spread per worker and step: one worker at a time
            return np.array([float(self.score_rows(int(g), row)) for g in workers])
        return self.score_row_against(row, self.envelope, self.loads[workers])

    def score_row_against(self, row: np.ndarray, envelope: np.ndarray,
                          loads: np.ndarray) -> np.ndarray:
        """F of one row of added work on workers whose projected loads are the rows of
        ``loads``, under ``envelope`` (:meth:`score_row_workers` with this table's; a caller
        that projects the fleet otherwise passes its own)."""
        over = np.maximum(0.0, row[None, :] - (envelope[None, :] - loads))
        return self.alpha * float(row @ self.d) - self.beta * (over * self.d).sum(axis=1)

    def admit_row(self, worker: int, row: np.ndarray) -> None:
        """Add per-step work ``row`` (shape ``(H+1,)``) to ``worker``; raise the envelope."""
        self._add(worker, np.asarray(row, dtype=np.float64))

    def admit(self, worker: int, D: float) -> None:
        """Add ``D`` tokens to ``worker`` at every horizon step and raise the envelope."""
        self._add(worker, D)

    def _add(self, worker: int, added: float | np.ndarray) -> None:
        row = self.loads[worker]
        row += added
        if (row > self.envelope).any():
            np.maximum(self.envelope, row, out=self.envelope)
            self._stale[:] = True  # every worker's margins moved where the envelope rose
        else:
            self._stale[worker] = True
