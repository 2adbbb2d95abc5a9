"""ExactMatch: one Kaplan-Meier curve per prompt key, falling back to Survival.

Memory is bounded by ``max_buckets`` curves of at most ``bucket_window`` observations each
(plus the global curve), whatever the number of distinct keys; the least recently updated
bucket is evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Self

from .base import BaseEstimator, Estimate, Features, Outcomes
from .km import KaplanMeier, residual_life
from .survival import SurvivalEstimator


def group_rows(keys: Sequence[str | None]) -> dict[str, list[int]]:
    """Row indices per key (rows without a key are left out), in first-seen order."""
    groups: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(index)
    return groups


class ExactMatchEstimator(BaseEstimator):
    """Per-prompt-key curves; a key with fewer than ``min_support`` observations in its
    bucket, or none, is answered by the global curve (:class:`SurvivalEstimator`).

    Args:
        window: the global curve's window (0: every observation).
        min_support: observations a key's bucket needs before it answers.
        max_buckets: bound on the number of keys held.
        bucket_window: observations kept per key.
    """

    name = "exact_match"

    def __init__(self, window: int = 5000, min_support: int = 8, max_buckets: int = 100_000,
                 bucket_window: int = 256) -> None:
        if min_support < 1:
            raise ValueError("min_support must be >= 1")
        if max_buckets < 1:
            raise ValueError("max_buckets must be >= 1")
        self.window = window
        self.min_support = min_support
        self.max_buckets = max_buckets
        self.bucket_window = bucket_window
        self.reset()

    def reset(self) -> Self:
        self.fallback_ = SurvivalEstimator(self.window)
        self.buckets_: OrderedDict[str, KaplanMeier] = OrderedDict()
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
        for key, rows in group_rows(outcomes.prompt_key).items():
            bucket = self.buckets_.get(key)
            if bucket is None:
                bucket = KaplanMeier(self.bucket_window)
                self.buckets_[key] = bucket
                if len(self.buckets_) > self.max_buckets:
                    self.buckets_.popitem(last=False)
            else:
                self.buckets_.move_to_end(key)
            bucket.partial_fit(outcomes.output_tokens[rows], outcomes.events[rows])
        return self

    def predict(self, features: Features, horizon: int) -> Estimate:
        answer = self.fallback_.predict(features, horizon)
        c_hat, p_fin, mu_rem = answer.c_hat.copy(), answer.p_fin.copy(), answer.mu_rem.copy()
        source = list(answer.source)
        support = answer.support.copy()
        for key, rows in group_rows(features.prompt_key).items():
            bucket = self.buckets_.get(key)
            if bucket is None or bucket.n_observed_ < self.min_support:
                continue
            life = residual_life(bucket.table_, features.generated[rows], horizon)
            c_hat[rows], p_fin[rows], mu_rem[rows] = life.c_hat, life.p_fin, life.mu_rem
            support[rows] = bucket.n_observed_
            for row in rows:
                source[row] = self.name
        return Estimate(c_hat, p_fin, mu_rem, source, support)
