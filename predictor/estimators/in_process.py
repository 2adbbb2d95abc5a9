"""An estimator as the router's ``Predictor`` (in process: the simulator and A/B runs).

It learns, in the order requests finish, only from what it is told has finished.
"""

from __future__ import annotations

import numpy as np

from router_client.predictors import ActiveBatch, FinishedBatch, Prediction

from .base import Estimator, Features, Outcomes, observe_running


class LearnerPredictor:
    def __init__(self, estimator: Estimator) -> None:
        self.estimator = estimator
        self.name = estimator.name

    def predict(self, batch: ActiveBatch, horizon: int) -> Prediction:
        features = Features.of(batch.generated_tokens, batch.prompt_keys, batch.prompt_tokens)
        observe_running([self.estimator], features)
        estimate = self.estimator.predict(features, horizon)
        return Prediction(estimate.c_hat, p_fin=estimate.p_fin, mu_rem=estimate.mu_rem)

    def observe(self, finished: FinishedBatch) -> None:
        self.estimator.partial_fit(Outcomes.of(
            finished.output_tokens, np.asarray(finished.censored, dtype=bool),
            finished.prompt_keys, finished.prompt_tokens,
        ))
