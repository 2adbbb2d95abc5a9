"""ExactMatch: one Kaplan-Meier curve per prompt key, shrunk toward Survival by its support.

A key seen ``n`` times answers from the blend of its own curve and the global one::

    S_key(t) = (n * S_bucket(t) + k * S_global(t)) / (n + k)

This is the posterior mean of the key's survival function under a Dirichlet-process prior
centred on the global curve with concentration ``k`` (with right-censoring, a blend of
Kaplan-Meier curves approximates that posterior). At ``n = 0`` it is Survival, as ``n``
grows it becomes the key's own Kaplan-Meier curve, and a key answers from its first
observation (``min_support`` defaults to 1).

``k`` (the prior's weight, in observations) is estimated by empirical Bayes: under that prior
any statistic of one observation has a share ``1 / (k + 1)`` of its variance between keys, so
``k = sigma_within^2 / tau_between^2``, estimated by the method of moments of the one-way
random-effects model on log output lengths (ended requests only; keys of one observation add
to the between-key spread, keys of two or more to the within-key spread)::

    sigma_w^2 = sum_i (n_i - 1) s_i^2 / sum_i (n_i - 1)
    tau^2     = var_i(mean_i) - sigma_w^2 * mean_i(1 / n_i)

It is re-estimated every ``refresh_every`` observations (deterministic), clipped to
``[K_MIN, K_MAX]``; until ``MIN_KEYS`` keys have two or more ended observations it is
``prior_weight`` (default 1: one observation of a key weighs as much as the global curve).
A positive ``prior_weight`` with ``estimate_weight=False`` fixes ``k``.

Residual life from the blend needs no blended curve: ``S(a)``, ``S(a+H)`` and
``sum_{h<H} S(a+h)`` are linear in the curve, so each is the same blend of the bucket's and
the global curve's terms (:func:`~predictor.estimators.km.curve_terms`).

Memory is bounded by ``max_buckets`` curves of at most ``bucket_window`` observations each
(plus the global curve), whatever the number of distinct keys; the least recently updated
bucket is evicted first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Self

import numpy as np

from .base import BaseEstimator, Estimate, Features, Outcomes
from .km import KaplanMeier, curve_terms, residual_from_terms
from .survival import SurvivalEstimator

K_MIN, K_MAX = 0.05, 1000.0
MIN_KEYS = 10


def group_rows(keys: Sequence[str | None]) -> dict[str, list[int]]:
    """Row indices per key (rows without a key are left out), in first-seen order."""
    groups: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(index)
    return groups


class Bucket:
    """One key: its windowed Kaplan-Meier curve and running moments of its ended log lengths."""

    __slots__ = ("curve", "logs", "total", "squares")

    def __init__(self, window: int) -> None:
        self.curve = KaplanMeier(window)
        self.logs: deque[float] = deque()
        self.total = 0.0
        self.squares = 0.0

    def add(self, durations: np.ndarray, events: np.ndarray, window: int) -> None:
        self.curve.partial_fit(durations, events)
        for value in np.log1p(durations[events]).tolist():
            self.logs.append(value)
            self.total += value
            self.squares += value * value
            if len(self.logs) > window:
                old = self.logs.popleft()
                self.total -= old
                self.squares -= old * old

    def terms(self, generated: np.ndarray, horizon: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        survival = self.curve.survival_
        prefix = np.concatenate([[0.0], np.cumsum(survival)])
        return curve_terms(survival, prefix, generated, horizon)


def estimate_prior_weight(stats: Sequence[tuple[int, float, float]]) -> float | None:
    """Empirical-Bayes ``k`` from per-key ``(n, sum, sum of squares)`` of log lengths; None
    when fewer than ``MIN_KEYS`` keys have two or more values."""
    counts = np.array([s[0] for s in stats if s[0] >= 1], dtype=np.float64)
    if counts.size == 0:
        return None
    sums = np.array([s[1] for s in stats if s[0] >= 1])
    squares = np.array([s[2] for s in stats if s[0] >= 1])
    means = sums / counts
    repeated = counts >= 2
    if int(repeated.sum()) < MIN_KEYS:
        return None
    within_ss = np.maximum(squares[repeated] - counts[repeated] * means[repeated] ** 2, 0.0)
    sigma2 = float(within_ss.sum() / (counts[repeated] - 1).sum())
    tau2 = float(means.var(ddof=1) - sigma2 * np.mean(1.0 / counts))
    if tau2 <= 0:
        return K_MAX
    return float(np.clip(sigma2 / tau2, K_MIN, K_MAX))


class ExactMatchEstimator(BaseEstimator):
    """Per-prompt-key curves shrunk toward the global curve (:class:`SurvivalEstimator`) by
    their support; a key never seen (or below ``min_support``) gets the global curve.

    Args:
        window: the global curve's window (0: every observation).
        min_support: observations a key's bucket needs before it answers (1: from the first).
        max_buckets: bound on the number of keys held.
        bucket_window: observations kept per key.
        prior_weight: ``k`` before it can be estimated (or always, see ``estimate_weight``).
        estimate_weight: estimate ``k`` by empirical Bayes from the buckets.
        refresh_every: observations between two estimates of ``k``.
    """

    name = "exact_match"

    def __init__(self, window: int = 5000, min_support: int = 1, max_buckets: int = 100_000,
                 bucket_window: int = 256, prior_weight: float = 1.0,
                 estimate_weight: bool = True, refresh_every: int = 500) -> None:
        if min_support < 1:
            raise ValueError("min_support must be >= 1")
        if max_buckets < 1:
            raise ValueError("max_buckets must be >= 1")
        if prior_weight < 0:
            raise ValueError("prior_weight must be >= 0")
        if refresh_every < 1:
            raise ValueError("refresh_every must be >= 1")
        self.window = window
        self.min_support = min_support
        self.max_buckets = max_buckets
        self.bucket_window = bucket_window
        self.prior_weight = prior_weight
        self.estimate_weight = estimate_weight
        self.refresh_every = refresh_every
        self.reset()

    def reset(self) -> Self:
        self.fallback_ = SurvivalEstimator(self.window)
        self.buckets_: OrderedDict[str, Bucket] = OrderedDict()
        self.prior_weight_ = float(self.prior_weight)
        self._since_refresh = 0
        return self

    @property
    def n_observed_(self) -> int:
        return self.fallback_.n_observed_

    @property
    def n_groups_(self) -> int:
        """Prompt keys held."""
        return len(self.buckets_)

    def partial_fit(self, outcomes: Outcomes) -> Self:
        self.fallback_.partial_fit(outcomes)
        events = outcomes.events
        for key, rows in group_rows(outcomes.prompt_key).items():
            bucket = self.buckets_.get(key)
            if bucket is None:
                bucket = Bucket(self.bucket_window)
                self.buckets_[key] = bucket
                if len(self.buckets_) > self.max_buckets:
                    self.buckets_.popitem(last=False)
            else:
                self.buckets_.move_to_end(key)
            bucket.add(outcomes.output_tokens[rows], events[rows], self.bucket_window)
        self._since_refresh += len(outcomes)
        if self.estimate_weight and self._since_refresh >= self.refresh_every:
            self._since_refresh = 0
            estimate = estimate_prior_weight(
                [(len(b.logs), b.total, b.squares) for b in self.buckets_.values()])
            self.prior_weight_ = self.prior_weight if estimate is None else estimate
        return self

    def predict(self, features: Features, horizon: int) -> Estimate:
        if self.fallback_.n_observed_ == 0:
            return self.fallback_.predict(features, horizon)
        n_items = len(features)
        table = self.fallback_.curve_.table_
        glob = curve_terms(table.extended, table.prefix, features.generated, horizon)
        mine = [np.zeros(n_items) for _ in range(3)]
        weight = np.zeros(n_items)
        source = [self.fallback_.name] * n_items
        for key, rows in group_rows(features.prompt_key).items():
            bucket = self.buckets_.get(key)
            if bucket is None or bucket.curve.n_observed_ < self.min_support:
                continue
            for column, values in zip(mine, bucket.terms(features.generated[rows], horizon),
                                      strict=True):
                column[rows] = values
            weight[rows] = bucket.curve.n_observed_
            for row in rows:
                source[row] = self.name
        k = self.prior_weight_
        blend = [(weight * b + k * g) / (weight + k) if k > 0
                 else np.where(weight > 0, b, g) for b, g in zip(mine, glob, strict=True)]
        life = residual_from_terms(blend[0], blend[1], blend[2], horizon)
        support = np.where(weight > 0, weight, self.fallback_.n_observed_).astype(np.int64)
        return Estimate(life.c_hat, life.p_fin, life.mu_rem, source, support)
