"""Survival: one Kaplan-Meier curve of output length over all requests (no features)."""

from __future__ import annotations

from typing import Self

import numpy as np

from .base import BaseEstimator, Estimate, Features, Outcomes
from .km import KaplanMeier, residual_life

TAIL_AT_RISK = 50  # README: "The curve's thin tail"


class SurvivalEstimator(BaseEstimator):
    """The empirical (censoring-aware) distribution of past output lengths.

    Args:
        window: the most recent observations the curve weighs (0: all of them).
        tail_at_risk: past the age where fewer requests than this are at risk (at most a
            tenth of the sample), the curve's hazard is pooled into one constant
            (:func:`~predictor.estimators.km.pool_tail`); 0 keeps the plain Kaplan-Meier.
    """

    name = "survival"

    def __init__(self, window: int = 5000, tail_at_risk: int = TAIL_AT_RISK) -> None:
        self.window = window
        self.tail_at_risk = tail_at_risk
        self.reset()

    def reset(self) -> Self:
        self.curve_ = KaplanMeier(self.window, self.tail_at_risk)
        return self

    @property
    def n_observed_(self) -> int:
        return self.curve_.n_observed_

    def partial_fit(self, outcomes: Outcomes) -> Self:
        self.curve_.partial_fit(outcomes.output_tokens, outcomes.events)
        return self

    def observe_running(self, features: Features) -> Self:
        """The requests running now (``generated`` tokens so far) count as right-censored at
        their current age until they finish. Learning only from finished requests would see
        mostly the short ones while the long ones still run (a young service, a burst); the
        running ones are the evidence that corrects it. At most ``max_running`` are kept (the
        first ones of the batch), so no single query can outweigh the window."""
        ages = features.generated[features.generated > 0][: self.max_running]
        self.curve_.set_running(ages)
        return self

    @property
    def max_running(self) -> int:
        return max(1, self.window // 2) if self.window else 2500

    def predict(self, features: Features, horizon: int) -> Estimate:
        n = len(features)
        if self.curve_.n_observed_ == 0:
            return Estimate.prior(n, horizon)
        life = residual_life(self.curve_.table_, features.generated, horizon)
        return Estimate(life.c_hat, life.p_fin, life.mu_rem, [self.name] * n,
                        np.full(n, self.curve_.n_observed_, dtype=np.int64))
