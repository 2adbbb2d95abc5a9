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

Memory is bounded in bytes, not only in counts: a key keeps its last ``bucket_window``
outcomes as compact arrays (about 800 bytes plus 6 per outcome, whatever the lengths; its
curve is a step function on the lengths it saw, see :class:`Bucket`), at most
``max_buckets`` keys and ``max_bytes`` of them are held (the least recently updated evicted
first), and the step curves cached for queries are bounded by ``cache_bytes`` (least recently
used dropped first). The global curve is one dense array per length up to the longest output
in its window (at most 1,048,576 tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice
from typing import Self

import numpy as np

from .base import BaseEstimator, Estimate, Features, Outcomes
from .km import curve_terms, residual_from_terms
from .survival import TAIL_AT_RISK, SurvivalEstimator

K_MIN, K_MAX = 0.01, 1000.0
MIN_KEYS = 10
BINS_PER_OCTAVE = 3
BINS_KEPT = 64  # most recent ended observations per key used to estimate k
KEYS_USED = 4096  # most recently updated keys used to estimate k
REFRESH_EVERY = 500  # observations between two estimates of k


def group_rows(keys: Sequence[str | None]) -> dict[str, list[int]]:
    """Row indices per key (rows without a key are left out), in first-seen order."""
    groups: dict[str | None, list[int]] = {}
    for index, key in enumerate(keys):
        rows = groups.get(key)
        if rows is None:  # (not setdefault: that builds a list per row; 1.8x slower)
            groups[key] = [index]
        else:
            rows.append(index)
    groups.pop(None, None)
    return groups  # type: ignore[return-value]


class Bucket:
    """One key: its most recent ``window`` outcomes (compact arrays) and the length bins of
    its ended outputs.

    The key's Kaplan-Meier curve is computed from the outcomes themselves, as a step function
    on the distinct lengths seen (:meth:`steps`), never as an array indexed by length: a key
    costs ``BUCKET_OVERHEAD`` bytes plus 6 per outcome it keeps, whatever the lengths, so an
    output of 1,048,576 tokens costs no more than one of 10. The curve is exact (the same as
    a dense Kaplan-Meier of the same outcomes)."""

    __slots__ = ("durations", "events", "bins", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self.durations = np.zeros(0, dtype=np.int32)  # lengths are <= 1,048,576
        self.events = np.zeros(0, dtype=bool)
        self.bins = np.zeros(0, dtype=np.int8)  # < 64 bins up to 2 ** 21

    @property
    def n_observed(self) -> int:
        return int(self.durations.shape[0])

    @property
    def nbytes(self) -> int:
        """Memory the bucket holds (its objects counted generously, and its arrays)."""
        return (BUCKET_OVERHEAD + self.durations.nbytes + self.events.nbytes
                + self.bins.nbytes)

    def add(self, durations: np.ndarray, events: np.ndarray,
            bins: np.ndarray | None = None) -> None:
        """Add outcomes; ``bins``: their :func:`length_bin` if known (all of them)."""
        keep = self.window
        self.durations = np.concatenate([self.durations, durations.astype(np.int32)])[-keep:]
        self.events = np.concatenate([self.events, events.astype(bool)])[-keep:]
        ended = (length_bin(durations) if bins is None else bins)[events].astype(np.int8)
        if ended.size:
            self.bins = np.concatenate([self.bins, ended])[-min(keep, BINS_KEPT):]

    def steps(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The key's Kaplan-Meier curve as a step function: knots ``k_j`` (0 and every
        length with an end), ``S(k_j)`` and ``sum_{t < k_j} S(t)``. At most one knot per
        outcome kept, whatever the lengths."""
        times, inverse = np.unique(self.durations, return_inverse=True)
        ends = np.bincount(inverse, weights=self.events, minlength=times.size)
        seen = np.bincount(inverse, minlength=times.size)
        at_risk = np.cumsum(seen[::-1])[::-1].astype(np.float64)
        after = np.cumprod(1.0 - ends / at_risk)  # S(t) at each distinct length
        change = ends > 0
        knots = times[change].astype(np.int64)
        values = after[change]
        if knots.size == 0 or knots[0] != 0:
            knots = np.concatenate([[0], knots])
            values = np.concatenate([[1.0], values])
        area = np.concatenate([[0.0], np.cumsum(values[:-1] * np.diff(knots))])
        return knots, values, area


BUCKET_OVERHEAD = 768  # bytes of a bucket's objects and its key's entry, besides array data


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
    lengths = np.fromiter((len(seq) for seq in repeated), np.int64, len(repeated))
    bins = np.concatenate([np.asarray(seq, dtype=np.int64) for seq in repeated])
    owner = np.repeat(np.arange(lengths.size), lengths)
    position = np.arange(bins.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    # m: earlier observations of the same key in the same bin (rank within (key, bin))
    order = np.lexsort((position, bins, owner))
    group = owner[order] * (int(bins.max()) + 1) + bins[order]
    starts = np.flatnonzero(np.concatenate([[True], group[1:] != group[:-1]]))
    rank = np.arange(order.size) - np.repeat(starts, np.diff(np.append(starts, order.size)))
    same = np.empty_like(rank)
    same[order] = rank
    later = position > 0  # the first observation of each key does not depend on k
    span = int(position.max()) + 1  # same < position < span: one code per distinct triple
    codes, count = np.unique((bins[later] * span + same[later]) * span + position[later],
                             return_counts=True)
    f = f0[codes // (span * span)][:, None]
    m = ((codes // span) % span).astype(np.float64)[:, None]
    n = (codes % span).astype(np.float64)[:, None]
    grid = np.geomspace(K_MIN, K_MAX, 81)[None, :]
    loglik = (count[:, None] * (np.log(grid * f + m) - np.log(grid + n))).sum(axis=0)
    return float(grid[0, int(np.argmax(loglik))])


class ExactMatchEstimator(BaseEstimator):
    """Per-prompt-key curves shrunk toward the global curve (:class:`SurvivalEstimator`) by
    their support; a key never seen (or below ``min_support``) gets the global curve.

    Args:
        window: the global curve's window (0: every observation).
        min_support: observations a key's bucket needs before it answers (1: from the first).
        max_buckets: bound on the number of keys held.
        max_bytes: bound on the keys' memory (see :class:`Bucket`), least recently updated
            evicted first.
        cache_bytes: bound on the memory of the step curves cached for queries.
        bucket_window: observations kept per key.
        prior_weight: ``k`` before it can be estimated (or always, see ``estimate_weight``).
        estimate_weight: estimate ``k`` by empirical Bayes from the buckets.
        refresh_every: observations between two estimates of ``k``.
        tail_at_risk: the global curve's pooled tail (see :class:`SurvivalEstimator`).
    """

    name = "exact_match"

    def __init__(self, window: int = 5000, min_support: int = 1, max_buckets: int = 100_000,
                 bucket_window: int = 256, prior_weight: float = 1.0,
                 estimate_weight: bool = True, refresh_every: int = REFRESH_EVERY,
                 max_bytes: int = 64 << 20, cache_bytes: int = 16 << 20,
                 tail_at_risk: int = TAIL_AT_RISK) -> None:
        if min_support < 1:
            raise ValueError("min_support must be >= 1")
        if max_buckets < 1:
            raise ValueError("max_buckets must be >= 1")
        if prior_weight < 0:
            raise ValueError("prior_weight must be >= 0")
        if refresh_every < 1:
            raise ValueError("refresh_every must be >= 1")
        if max_bytes < 1 or cache_bytes < 1:
            raise ValueError("max_bytes and cache_bytes must be >= 1")
        self.window = window
        self.min_support = min_support
        self.max_buckets = max_buckets
        self.bucket_window = bucket_window
        self.prior_weight = prior_weight
        self.estimate_weight = estimate_weight
        self.refresh_every = refresh_every
        self.max_bytes = max_bytes
        self.cache_bytes = cache_bytes
        self.tail_at_risk = tail_at_risk
        self.reset()

    def reset(self) -> Self:
        self.fallback_ = SurvivalEstimator(self.window, self.tail_at_risk)
        self.buckets_: OrderedDict[str, Bucket] = OrderedDict()
        self.bytes_ = 0  # the buckets' memory (Bucket.nbytes plus their keys)
        self._steps: OrderedDict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self.steps_bytes_ = 0
        self.prior_weight_ = float(self.prior_weight)
        self._since_refresh = 0
        self._deferred: list[np.ndarray] | None = None
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
        return self.learn_keys(outcomes)

    def load_key_state(self, state) -> Self:
        """Set the keys (least recently updated first, each with its newest outcomes and
        ended bins) and the point of the refresh schedule from a
        :class:`~predictor.snapshots.KeyState`: how a restart rebuilds what :meth:`learn_keys`
        kept of the observations it does not replay."""
        self.buckets_.clear()
        self._steps.clear()
        self.bytes_ = self.steps_bytes_ = 0
        for key, durations, events, bins in state.buckets():
            bucket = Bucket(self.bucket_window)
            bucket.durations, bucket.events, bucket.bins = durations, events, bins
            self.buckets_[key] = bucket
            self.bytes_ += bucket.nbytes + len(key)
        self._since_refresh = state.since_refresh
        self.prior_weight_ = (self.prior_weight if state.prior_weight is None
                              else state.prior_weight)
        return self

    def learn_keys(self, outcomes: Outcomes) -> Self:
        """The per-key part of :meth:`partial_fit` (the global curve left alone)."""
        events = outcomes.events
        bins = length_bin(outcomes.output_tokens)
        for key, rows in group_rows(outcomes.prompt_key).items():
            bucket = self.buckets_.get(key)
            if bucket is None:
                bucket = Bucket(self.bucket_window)
                self.buckets_[key] = bucket
            else:
                self.buckets_.move_to_end(key)
                self.bytes_ -= bucket.nbytes + len(key)
                self._drop_steps(key)
            bucket.add(outcomes.output_tokens[rows], events[rows], bins[rows])
            self.bytes_ += bucket.nbytes + len(key)
            while len(self.buckets_) > 1 and (len(self.buckets_) > self.max_buckets
                                              or self.bytes_ > self.max_bytes):
                old_key, old = self.buckets_.popitem(last=False)  # least recently updated
                self.bytes_ -= old.nbytes + len(old_key)
                self._drop_steps(old_key)
        self._since_refresh += len(outcomes)
        if self.estimate_weight and self._since_refresh >= self.refresh_every:
            self._since_refresh = 0
            recent = islice(reversed(self.buckets_.values()), KEYS_USED)
            held = [b.bins for b in recent if b.bins.size][::-1]  # never mutated: a snapshot
            if self.defer_refresh or self.defer_fits:
                self._deferred = held
            else:
                self._refresh(held)
        return self

    # Replaying stored batches (a restart) sets ``defer_refresh``: a due estimate of k keeps
    # only its input (references to the keys' bin arrays, which are replaced, not changed);
    # :meth:`refresh_deferred` estimates from the newest once the replay is done. The same k
    # as estimating at every due point, for the cost of one estimate.
    defer_refresh = False

    def refresh_deferred(self) -> None:
        self.defer_refresh = False
        if self._deferred is not None:
            self._refresh(self._deferred)
            self._deferred = None

    # A service must not hold the lock its queries take while k is estimated (a few ms per
    # estimate, about half of what a batch of 1,000 observations held it for): it sets
    # ``defer_fits`` and calls :meth:`fit_deferred` after each ingested batch, as it does for
    # the hazard model's fits. The estimate is of the newest due point's keys, as inline, so
    # once the deferred work is done k is what it would have been (and what a restart, which
    # estimates once from the newest due point, rebuilds); until then queries use the one
    # before.
    defer_fits = False

    def fit_deferred(self, lock) -> bool:
        """Estimate k if one is due: the due point's keys taken under ``lock``, the estimate
        outside it, installed under it."""
        with lock:
            held, self._deferred = self._deferred, None
        if held is None:
            return False
        try:
            weight = self._estimate(held)
        except Exception:
            with lock:  # kept for the next run, unless a newer due point replaced it
                if self._deferred is None:
                    self._deferred = held
            raise
        with lock:
            self.prior_weight_ = weight
        return True

    def _estimate(self, bins: list[np.ndarray]) -> float:
        """k from the keys' bins (``prior_weight`` until it can be estimated)."""
        estimate = estimate_prior_weight([b.tolist() for b in bins])
        return self.prior_weight if estimate is None else estimate

    def _refresh(self, bins: list[np.ndarray]) -> None:
        self.prior_weight_ = self._estimate(bins)

    def _steps_of(self, key: str, bucket: Bucket) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A key's step curve, from a cache bounded by ``cache_bytes`` (least recently used
        dropped first; a key's entry is dropped when the key learns)."""
        got = self._steps.get(key)
        if got is not None:
            self._steps.move_to_end(key)
            return got
        got = bucket.steps()
        self._steps[key] = got
        self.steps_bytes_ += _steps_nbytes(key, got)
        while self.steps_bytes_ > self.cache_bytes and len(self._steps) > 1:
            old_key, old = self._steps.popitem(last=False)
            self.steps_bytes_ -= _steps_nbytes(old_key, old)
        return got

    def _drop_steps(self, key: str) -> None:
        old = self._steps.pop(key, None)
        if old is not None:
            self.steps_bytes_ -= _steps_nbytes(key, old)

    def predict(self, features: Features, horizon: int) -> Estimate:
        if self.fallback_.n_observed_ == 0:
            return self.fallback_.predict(features, horizon)
        table = self.fallback_.curve_.table_
        glob = curve_terms(table.extended, table.prefix, features.generated, horizon)
        blend, weight = self.shrink(features, horizon, glob)
        life = residual_from_terms(blend[0], blend[1], blend[2], horizon)
        names = (self.fallback_.name, self.name)
        source = [names[known] for known in (weight > 0).tolist()]
        support = np.where(weight > 0, weight, self.fallback_.n_observed_).astype(np.int64)
        return Estimate(life.c_hat, life.p_fin, life.mu_rem, source, support)

    def shrink(self, features: Features, horizon: int, prior: Sequence[np.ndarray]
               ) -> tuple[list[np.ndarray], np.ndarray]:
        """Each item's curve terms (``S(a)``, ``S(a+H)``, ``sum_{h<H} S(a+h)``) from its key's
        curve shrunk toward ``prior`` (the same terms of the curve it would get without a
        key): the mixture ``(n * key + k * prior) / (n + k)``, ``n`` the key's support.
        Returns the terms and ``n`` (0 where the key is unknown or below ``min_support``: the
        prior's terms unchanged)."""
        steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        rows: list[int] = []
        owner: list[int] = []
        support_of: list[int] = []
        buckets, least = self.buckets_, self.min_support
        for key, key_rows in group_rows(features.prompt_key).items():
            bucket = buckets.get(key)
            if bucket is None or bucket.n_observed < least:
                continue
            owner.extend([len(steps)] * len(key_rows))
            support_of.append(bucket.n_observed)
            steps.append(self._steps_of(key, bucket))
            rows.extend(key_rows)
        weight = np.zeros(len(features))
        mine = [column.copy() for column in prior]
        if steps:
            index = np.asarray(rows, dtype=np.int64)
            owners = np.asarray(owner, dtype=np.int64)
            weight[index] = np.asarray(support_of, dtype=np.float64)[owners]
            terms = stacked_terms(steps, owners, features.generated[index], horizon)
            for column, values in zip(mine, terms, strict=True):
                column[index] = values
        k = self.prior_weight_
        blend = [(weight * b + k * g) / (weight + k) if k > 0
                 else np.where(weight > 0, b, g) for b, g in zip(mine, prior, strict=True)]
        return blend, weight


def _steps_nbytes(key: str, steps: tuple[np.ndarray, ...]) -> int:
    return STEPS_OVERHEAD + len(key) + sum(a.nbytes for a in steps)


STEPS_OVERHEAD = 512  # a cached step curve's objects (tuple, three arrays, entry)
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
