"""Estimators of expected capped remaining life, and their registry.

Plain numpy objects with no web or database code: the service and the simulator use the same
instances. Adding one is a new module here plus one ``register_estimator`` line below.
"""

from typing import Any

from ..settings import Settings
from .base import (
    PRIOR,
    UNKNOWN_TOKENS,
    BaseEstimator,
    Estimate,
    Estimator,
    Features,
    NotFittedError,
    Outcomes,
)
from .exact_match import ExactMatchEstimator
from .hazard import HazardEstimator
from .registry import (
    EstimatorSpec,
    UnknownEstimatorError,
    estimator_names,
    estimator_spec,
    estimator_specs,
    register_estimator,
    spec_for_policy,
    unregister_estimator,
)
from .survival import SurvivalEstimator


def _exact_match_params(s: Settings) -> dict[str, Any]:
    """ExactMatch's arguments from the settings (its own, and the hazard model's key curves)."""
    return dict(window=s.history, min_support=s.exact_match_min_support,
                max_buckets=s.exact_match_max_buckets, bucket_window=s.exact_match_bucket_window,
                prior_weight=s.exact_match_prior_weight,
                estimate_weight=s.exact_match_estimate_weight,
                max_bytes=s.exact_match_max_bytes, cache_bytes=s.exact_match_cache_bytes,
                tail_at_risk=s.survival_tail_at_risk)


register_estimator(EstimatorSpec(
    "survival", lambda s: SurvivalEstimator(window=s.history, tail_at_risk=s.survival_tail_at_risk),
    description="one Kaplan-Meier curve over all requests"))
register_estimator(EstimatorSpec(
    "exact_match", lambda s: ExactMatchEstimator(**_exact_match_params(s)),
    policy="brh-exactmatch",
    description="a Kaplan-Meier curve per prompt key shrunk toward Survival by its support"))
register_estimator(EstimatorSpec(
    "hazard", lambda s: HazardEstimator(
        window=s.history or 5000, refit_every=s.hazard_refit_every,
        max_keys=s.exact_match_max_buckets, key_params=_exact_match_params(s)),
    description="discrete-time hazard model (gradient boosting) on prompt length and key "
                "statistics, each key's own curve shrunk toward it"))

__all__ = [
    "PRIOR", "UNKNOWN_TOKENS", "BaseEstimator", "Estimate", "Estimator", "EstimatorSpec",
    "ExactMatchEstimator", "Features", "HazardEstimator", "NotFittedError", "Outcomes",
    "SurvivalEstimator",
    "UnknownEstimatorError", "estimator_names", "estimator_spec", "estimator_specs",
    "register_estimator", "spec_for_policy", "unregister_estimator",
]
