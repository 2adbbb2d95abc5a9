"""Kaplan-Meier survival curves of output length, and residual life from a curve.

``KaplanMeier`` learns ``S(t) = P(o > t)`` from finished requests, with right-censoring:
outputs cut by ``length``, ``cancelled`` or ``error`` are at risk up to their length but are
not events. It is online (``partial_fit`` updates event and censoring counts; nothing is refit
from scratch) and keeps a sliding window of the most recent ``window`` observations (``0``:
all of them, plain Kaplan-Meier). A window rather than a decay keeps the estimate an exact
Kaplan-Meier of a well-defined set of requests: it can be checked against lifelines, rebuilt
from the database after a restart, and it forgets a past workload completely after ``window``
new observations.

``residual_life`` turns a survival curve into, for a request that has generated ``a`` tokens::

    c_hat = sum_{h=0}^{H-1} S(a+h) / S(a)      p_fin = 1 - S(a+H) / S(a)
    mu_rem = (c_hat - (1 - p_fin) * H) / p_fin (mean remaining given that it ends within H)

Past the largest observed length the curve is taken as flat (no event was ever seen there),
and a request with ``S(a) = 0`` (it outlived every observed output) gets the conservative
prior ``c_hat = H``, ``p_fin = 0``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .base import NotFittedError

SHRINK_FROM = 4096  # arrays shorter than this are never shrunk


class KaplanMeier:
    """Online, windowed Kaplan-Meier estimator of ``S(t) = P(o > t)`` on integer lengths."""

    def __init__(self, window: int = 0, tail_at_risk: int = 0) -> None:
        if window < 0:
            raise ValueError("window must be >= 0 (0 keeps every observation)")
        if tail_at_risk < 0:
            raise ValueError("tail_at_risk must be >= 0 (0: plain Kaplan-Meier)")
        self.window = window
        self.tail_at_risk = tail_at_risk
        self.reset()

    def reset(self) -> KaplanMeier:
        self.events_ = np.zeros(1, dtype=np.int64)
        self.censored_ = np.zeros(1, dtype=np.int64)
        self.n_observed_ = 0
        self.running_ = np.zeros(1, dtype=np.int64)  # requests still running, by age
        self._recent: deque[tuple[int, bool]] = deque()
        self._evicted = 0
        self._survival: np.ndarray | None = None
        self._table: ResidualTable | None = None
        return self

    def fit(self, durations: Sequence[int] | np.ndarray,
            events: Sequence[bool] | np.ndarray) -> KaplanMeier:
        return self.reset().partial_fit(durations, events)

    def partial_fit(self, durations: Sequence[int] | np.ndarray,
                    events: Sequence[bool] | np.ndarray) -> KaplanMeier:
        """Add observations: ``events[i]`` is True for an observed end, False if censored."""
        durations = np.asarray(durations, dtype=np.int64)
        events = np.asarray(events, dtype=bool)
        if durations.shape != events.shape:
            raise ValueError("durations and events must have the same length")
        if durations.size == 0:
            return self
        if (durations < 0).any():
            raise ValueError("durations must be >= 0")
        self._grow(int(durations.max()))
        np.add.at(self.events_, durations[events], 1)
        np.add.at(self.censored_, durations[~events], 1)
        self.n_observed_ += int(durations.size)
        if self.window:
            self._recent.extend(zip(durations.tolist(), events.tolist(), strict=True))
            while len(self._recent) > self.window:
                old, was_event = self._recent.popleft()
                (self.events_ if was_event else self.censored_)[old] -= 1
                self.n_observed_ -= 1
                self._evicted += 1
            if self._evicted >= self.window:
                self._evicted = 0
                self._shrink()
        self._survival = None
        return self

    def _shrink(self) -> None:
        """Give back the arrays' tail once the longest output left the window: the curve
        costs memory for the lengths it holds now, not the longest it ever saw."""
        longest = max(length for length, _ in self._recent) if self._recent else 0
        size = self.events_.shape[0]
        if size > SHRINK_FROM and size > 2 * (longest + 1):
            keep = max(longest + 1, SHRINK_FROM)
            self.events_ = self.events_[:keep].copy()
            self.censored_ = self.censored_[:keep].copy()
            tail = int(self.running_[keep:].sum())  # running ages past the end: just past it
            self.running_ = self.running_[:keep].copy()
            self.running_[keep - 1] += tail
            self._table = None

    def set_running(self, ages: np.ndarray) -> KaplanMeier:
        """Requests still running, at their current ages: right-censored evidence (each has
        lived at least that long) until it finishes. Replaces the previous running set. An
        age past the longest finished observation counts as censored just past it (the same
        for the curve, and the arrays do not grow)."""
        ages = np.minimum(np.asarray(ages, dtype=np.int64), self.events_.shape[0] - 1)
        self.running_ = np.bincount(ages[ages > 0], minlength=self.events_.shape[0])
        self._survival = None
        return self

    def _grow(self, longest: int) -> None:
        if longest >= self.events_.shape[0]:
            size = max(longest + 1, 2 * self.events_.shape[0])
            self.events_ = np.pad(self.events_, (0, size - self.events_.shape[0]))
            self.censored_ = np.pad(self.censored_, (0, size - self.censored_.shape[0]))
            self.running_ = np.pad(self.running_, (0, size - self.running_.shape[0]))

    @property
    def survival_(self) -> np.ndarray:
        """``S(t)`` for t = 0..T (T the largest length seen); flat beyond."""
        if self.n_observed_ == 0:
            raise NotFittedError("no observations yet")
        if self._survival is None:
            counts = self.events_ + self.censored_ + self.running_
            last = int(np.flatnonzero(counts)[-1])
            events = self.events_[: last + 1].astype(np.float64)
            at_risk = np.cumsum(counts[: last + 1][::-1])[::-1].astype(np.float64)
            hazard = np.divide(events, at_risk, out=np.zeros_like(events), where=at_risk > 0)
            pool_tail(hazard, events, at_risk, self.tail_at_risk)
            self._survival = np.cumprod(1.0 - hazard)
            self._table = None
        return self._survival

    @property
    def table_(self) -> ResidualTable:
        """The cached :class:`ResidualTable` of the current curve."""
        if self._table is None or self._survival is None:
            self._table = ResidualTable.of(self.survival_)
        return self._table

    def survival_at(self, t: np.ndarray | int) -> np.ndarray:
        curve = self.survival_
        return curve[np.minimum(np.asarray(t, dtype=np.int64), curve.shape[0] - 1)]


TAIL_SHARE = 10  # the pooled tail holds at most a tenth of the sample


def pool_tail(hazard: np.ndarray, events: np.ndarray, at_risk: np.ndarray,
              tail_at_risk: int) -> None:
    """Replace, in place, the hazard of the curve's thin tail by its pooled estimate.

    Where fewer than ``tail_at_risk`` requests are at risk (and at most a tenth of the
    sample: a small sample keeps its plain curve), each step's hazard ``events / at_risk``
    rests on a handful of requests: the curve falls to 0 at the last event, and a request that
    old is predicted to end within H almost surely, while a long-lived one is as likely to run
    on. The tail instead gets one constant hazard, its events over its exposure (the
    requests at risk summed over its steps, the maximum-likelihood estimate of a constant
    discrete hazard): a geometric tail, the piecewise-exponential model past the last well-
    supported age. ``tail_at_risk = 0`` leaves the plain Kaplan-Meier curve.
    """
    if tail_at_risk <= 0 or at_risk.size == 0:
        return
    threshold = min(float(tail_at_risk), at_risk[0] / TAIL_SHARE)
    thin = np.flatnonzero(at_risk < threshold)  # at_risk never rises: a suffix
    if thin.size == 0:
        return
    start = int(thin[0])
    exposure = float(at_risk[start:].sum())
    if exposure > 0:
        hazard[start:] = float(events[start:].sum()) / exposure


@dataclass(frozen=True)
class ResidualLife:
    """Per-request answers; ``mu_rem`` is NaN where ``p_fin`` is 0."""

    c_hat: np.ndarray
    p_fin: np.ndarray
    mu_rem: np.ndarray


MAX_HORIZON = 4096


@dataclass(frozen=True)
class ResidualTable:
    """A survival curve extended flat by ``MAX_HORIZON + 1`` and its prefix sums: built once
    per curve, it answers any (a, H) query with two lookups."""

    extended: np.ndarray
    prefix: np.ndarray
    tail: int

    @classmethod
    def of(cls, survival: np.ndarray, horizon: int = MAX_HORIZON) -> ResidualTable:
        extended = np.concatenate([survival, np.full(horizon + 1, survival[-1])])
        prefix = np.concatenate([[0.0], np.cumsum(extended)])
        return cls(extended, prefix, int(survival.shape[0]))


def residual_life(survival: np.ndarray | ResidualTable, generated: np.ndarray,
                  horizon: int) -> ResidualLife:
    """``c_hat``, ``p_fin``, ``mu_rem`` for requests that generated ``generated`` tokens."""
    table = (survival if isinstance(survival, ResidualTable)
             else ResidualTable.of(survival, horizon))
    if horizon > table.extended.shape[0] - table.tail - 1:
        raise ValueError(f"horizon {horizon} beyond the table's {MAX_HORIZON}")
    generated = np.asarray(generated, dtype=np.int64)
    extended, prefix, tail = table.extended, table.prefix, table.tail
    at = np.minimum(generated, tail)  # flat beyond the curve: tail index is as good as any
    return residual_from_terms(extended[at], extended[at + horizon],
                               prefix[at + horizon] - prefix[at], horizon)


def curve_terms(survival: np.ndarray, prefix: np.ndarray, generated: np.ndarray,
                horizon: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``S(a)``, ``S(a+H)`` and ``sum_{h<H} S(a+h)`` on a curve taken as flat past its end.

    ``prefix`` is ``[0, cumsum(survival)]``. Unlike :class:`ResidualTable` nothing is padded,
    so a curve costs only its own length (ExactMatch keeps one per prompt key). The three
    terms are linear in the curve, so the terms of a mixture of curves are the mixture of
    their terms (how ExactMatch blends a key's curve with the global one).
    """
    tail = survival.shape[0] - 1
    last = survival[-1]
    generated = np.asarray(generated, dtype=np.int64)

    def cumulative(upto: np.ndarray) -> np.ndarray:  # sum_{t < upto} S(t)
        inside = np.minimum(upto, tail + 1)
        return prefix[inside] + (upto - inside) * last

    s_now = survival[np.minimum(generated, tail)]
    s_end = survival[np.minimum(generated + horizon, tail)]
    return s_now, s_end, cumulative(generated + horizon) - cumulative(generated)


def residual_from_terms(s_now: np.ndarray, s_end: np.ndarray, area: np.ndarray,
                        horizon: int) -> ResidualLife:
    """Residual life from ``S(a)``, ``S(a+H)`` and ``sum_{h<H} S(a+h)`` (see the module)."""
    known = s_now > 0
    safe = np.where(known, s_now, 1.0)
    c_hat = np.where(known, area / safe, float(horizon))
    p_fin = np.where(known, 1.0 - s_end / safe, 0.0)
    c_hat = np.clip(c_hat, 0.0, float(horizon))
    p_fin = np.clip(p_fin, 0.0, 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mu_rem = np.where(p_fin > 0, (c_hat - (1.0 - p_fin) * horizon) / p_fin, np.nan)
    mu_rem = np.where(p_fin > 0, np.clip(mu_rem, 0.0, float(horizon)), np.nan)
    return ResidualLife(c_hat, p_fin, mu_rem)
