"""ExactMatch: one Kaplan-Meier curve per prompt key, shrunk toward Survival by its support.

A key seen ``n`` times answers from the blend of its own curve and the global one::

    S_key(t) = (n * S_bucket(t) + k * S_global(t)) / (n + k)

This is the posterior mean of the key's survival function under a Dirichlet-process prior
centred on the global curve with concentration ``k`` (with right-censoring, a blend of
Kaplan-Meier curves approximates that posterior). At ``n = 0`` it is Survival, as ``n``
grows it becomes the key's own Kaplan-Meier curve, and a key answers from its first
observation (``min_support`` defaults to 1).

``k`` (the prior's weight, in observations) is estimated by empirical Bayes: the ``k`` that
maximizes the Dirichlet-process marginal likelihood of each key's sequence of ended output
lengths, binned on a log scale (3 bins per doubling): under ``DP(k, F0)`` a key's i-th
observation falls in bin b with probability ``(k F0(b) + m_b) / (k + i - 1)``, ``m_b`` its
earlier observations in b, ``F0`` the pooled frequency (:func:`estimate_prior_weight`, over
the 64 most recent ended observations of the 4096 most recently updated keys, on a grid of
81 values in ``[K_MIN, K_MAX]``). This is the quantity the blend needs: how often a key's
next length lands where its earlier ones did, beyond what the global curve predicts. (A
variance ratio of log lengths, the normal-model choice, over-trusts one observation: the
blend puts the key's weight on atoms at its observed lengths, not on a smooth bump around
them; on Mooncake conversations it made the blend worse than Survival.) It is re-estimated
every ``refresh_every`` observations (deterministic); until ``MIN_KEYS`` keys have two or
more ended observations it is ``prior_weight`` (default 1: one observation of a key weighs as
much as the global curve). ``estimate_weight=False`` fixes ``k = prior_weight``.

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

K_MIN, K_MAX = 0.01, 1000.0
MIN_KEYS = 10
BINS_PER_OCTAVE = 3
BINS_KEPT = 64  # most recent ended observations per key used to estimate k
KEYS_USED = 4096  # most recently updated keys used to estimate k


def group_rows(keys: Sequence[str | None]) -> dict[str, list[int]]:
    """Row indices per key (rows without a key are left out), in first-seen order."""
    groups: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(index)
    return groups


class Bucket:
    """One key: its windowed Kaplan-Meier curve and the length bins of its ended outputs."""

    __slots__ = ("curve", "bins", "_steps")

    def __init__(self, window: int) -> None:
        self.curve = KaplanMeier(window)
        self.bins: deque[int] = deque(maxlen=min(window, BINS_KEPT))
        self._steps: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def add(self, durations: np.ndarray, events: np.ndarray) -> None:
        self.curve.partial_fit(durations, events)
        self.bins.extend(length_bin(durations[events]).tolist())
        self._steps = None

    def steps(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The curve as a step function, cached until the key's next observation: knots
        ``k_j`` (0 and every change), ``S(k_j)`` and ``sum_{t < k_j} S(t)``. A key's curve
        changes at most once per observation, so this is small whatever the lengths."""
        if self._steps is None:
            survival = self.curve.survival_
            knots = np.concatenate([[0], np.flatnonzero(np.diff(survival)) + 1])
            area = np.concatenate([[0.0], np.cumsum(survival)])[knots]
            self._steps = (knots, survival[knots], area)
        return self._steps


def length_bin(lengths: np.ndarray) -> np.ndarray:
    """Log-spaced bins of output length, ``BINS_PER_OCTAVE`` per doubling."""
    return np.floor(np.log2(np.asarray(lengths, dtype=np.float64) + 1.0)
                    * BINS_PER_OCTAVE).astype(np.int64)


def estimate_prior_weight(sequences: Sequence[Sequence[int]]) -> float | None:
    """Empirical-Bayes ``k``: the concentration maximizing the Dirichlet-process marginal
    likelihood of each key's sequence of length bins, or None with fewer than ``MIN_KEYS``
    keys of two or more ended observations.

    Under ``DP(k, F0)`` the i-th observation of a key falls in bin b with probability
    ``(k F0(b) + m) / (k + i - 1)``, ``m`` the key's earlier observations in b; ``F0`` is the
    pooled bin frequency. The first observation of each key does not depend on ``k``.
    """
    repeated = [seq for seq in sequences if len(seq) >= 2]
    if len(repeated) < MIN_KEYS:
        return None
    pooled = np.bincount(np.concatenate([np.asarray(seq) for seq in sequences]))
    f0 = pooled / pooled.sum()
    share, same, before = [], [], []
    for seq in repeated:
        seen: dict[int, int] = {}
        for i, b in enumerate(seq):
            if i:
                share.append(f0[b])
                same.append(seen.get(b, 0))
                before.append(i)
            seen[b] = seen.get(b, 0) + 1
    f, m, n = (np.asarray(v, dtype=np.float64)[:, None] for v in (share, same, before))
    grid = np.geomspace(K_MIN, K_MAX, 81)[None, :]
    loglik = (np.log(grid * f + m) - np.log(grid + n)).sum(axis=0)
    return float(grid[0, int(np.argmax(loglik))])


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

    def observe_running(self, features: Features) -> Self:
        """Running requests as censored evidence for the global curve (see Survival)."""
        self.fallback_.observe_running(features)
        return self

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
            bucket.add(outcomes.output_tokens[rows], events[rows])
        self._since_refresh += len(outcomes)
        if self.estimate_weight and self._since_refresh >= self.refresh_every:
            self._since_refresh = 0
            recent = list(self.buckets_.values())[-KEYS_USED:]
            estimate = estimate_prior_weight([list(b.bins) for b in recent if b.bins])
            self.prior_weight_ = self.prior_weight if estimate is None else estimate
        return self

    def predict(self, features: Features, horizon: int) -> Estimate:
        if self.fallback_.n_observed_ == 0:
            return self.fallback_.predict(features, horizon)
        n_items = len(features)
        table = self.fallback_.curve_.table_
        glob = curve_terms(table.extended, table.prefix, features.generated, horizon)
        steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        rows: list[int] = []
        owner: list[int] = []
        support_of: list[int] = []
        buckets, least = self.buckets_, self.min_support
        for key, key_rows in group_rows(features.prompt_key).items():
            bucket = buckets.get(key)
            if bucket is None or bucket.curve.n_observed_ < least:
                continue
            owner.extend([len(steps)] * len(key_rows))
            support_of.append(bucket.curve.n_observed_)
            steps.append(bucket.steps())
            rows.extend(key_rows)
        weight = np.zeros(n_items)
        mine = [column.copy() for column in glob]
        source = [self.fallback_.name] * n_items
        if steps:
            index = np.asarray(rows, dtype=np.int64)
            owners = np.asarray(owner, dtype=np.int64)
            weight[index] = np.asarray(support_of, dtype=np.float64)[owners]
            terms = stacked_terms(steps, owners, features.generated[index], horizon)
            for column, values in zip(mine, terms, strict=True):
                column[index] = values
            for row in rows:
                source[row] = self.name
        k = self.prior_weight_
        blend = [(weight * b + k * g) / (weight + k) if k > 0
                 else np.where(weight > 0, b, g) for b, g in zip(mine, glob, strict=True)]
        life = residual_from_terms(blend[0], blend[1], blend[2], horizon)
        support = np.where(weight > 0, weight, self.fallback_.n_observed_).astype(np.int64)
        return Estimate(life.c_hat, life.p_fin, life.mu_rem, source, support)


SPAN = 1 << 24  # > any length + horizon: offsets that keep the keys' knots apart


def stacked_terms(steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]], owner: np.ndarray,
                  generated: np.ndarray, horizon: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`~predictor.estimators.km.curve_terms` of many step curves at once: item i reads
    curve ``owner[i]``; the knots are concatenated with offsets, so one ``searchsorted``
    answers every item."""
    offset = np.repeat(np.arange(len(steps), dtype=np.int64) * SPAN,
                       [knots.shape[0] for knots, _, _ in steps])
    knots = np.concatenate([k for k, _, _ in steps])
    value = np.concatenate([v for _, v, _ in steps])
    area = np.concatenate([a for _, _, a in steps])
    shifted = knots + offset
    base = owner * SPAN

    def at(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        j = np.searchsorted(shifted, base + t, side="right") - 1
        return value[j], area[j] + (t - knots[j]) * value[j]

    s_now, before = at(generated)
    s_end, upto = at(generated + horizon)
    return s_now, s_end, upto - before
