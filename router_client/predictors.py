"""The ``Predictor`` protocol through which BR-H gets ``c_hat``, and the oracle.

A predictor answers, for a batch of active requests, the expected capped remaining life
``c_hat`` in ``[0, H]`` of each; and it may learn from finished requests. The in-process
estimators (``predictor.estimators``), the HTTP client of the prediction service and the
oracle all satisfy it; this package imports none but the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class ActiveBatch:
    """Active requests to predict for; ``request_ids`` are opaque to the router."""

    request_ids: np.ndarray
    prompt_tokens: np.ndarray
    generated_tokens: np.ndarray
    prompt_keys: list[str | None]


@dataclass(frozen=True)
class FinishedBatch:
    """Requests that ended: ``censored`` for cut (max_tokens), cancelled or failed ones."""

    request_ids: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    censored: np.ndarray
    prompt_keys: list[str | None]
    finish_reasons: list[str] | None = None  # stop | length | cancelled | error, when known


@dataclass(frozen=True)
class Prediction:
    """``c_hat`` per request, or ``None`` when the predictor cannot answer (then BR-0).

    ``p_fin`` and ``mu_rem``, when given, let the projection use the two-point law they
    describe instead of a deterministic end at ``c_hat`` (see
    :func:`~router_client.projection.mixture_loads`).
    ``recommendation`` is the service's current advice on which policy to run, when it has
    one: ``{"policy": "br0"}`` or ``{"policy": "brh", "horizon", "beta", "gamma",
    "estimator"}`` (see ``balanceroute tune``).
    ``warming`` (with ``c_hat`` None) says the predictor has not answered yet, its first
    query still running (a proxy's background refresh at start): the router routes as BR-0
    meanwhile, but it is not a failure (no fallback switch, no failed refresh counted).
    """

    c_hat: np.ndarray | None
    drifted: bool = False
    warming: bool = False
    recommendation: dict | None = None
    p_fin: np.ndarray | None = None  # P(ends within H), when the predictor knows it
    mu_rem: np.ndarray | None = None  # mean remaining if it does (NaN where p_fin is 0)


@runtime_checkable
class Predictor(Protocol):
    name: str

    def predict(self, batch: ActiveBatch, horizon: int) -> Prediction: ...

    def observe(self, finished: FinishedBatch) -> None: ...


class OraclePredictor:
    """True remaining lengths (simulation only): ``c = min(o - a, H)``.

    ``output_tokens[request_id]`` is the true output length of request ``request_id``.
    """

    name = "oracle"

    def __init__(self, output_tokens: np.ndarray) -> None:
        self.output_tokens = np.asarray(output_tokens, dtype=np.int64)

    def predict(self, batch: ActiveBatch, horizon: int) -> Prediction:
        remaining = self.output_tokens[batch.request_ids.astype(np.int64)] - batch.generated_tokens
        return Prediction(np.clip(remaining, 0, horizon).astype(np.float64))

    def observe(self, finished: FinishedBatch) -> None:
        return None


def aged_c_hat(c_hat: np.ndarray, elapsed: np.ndarray, horizon: int) -> np.ndarray:
    """A ``c_hat`` answered ``elapsed`` steps ago, as of now: ``max(c_hat - elapsed, 1)``.

    An answer at the cap H stays at H ("at least H" says nothing about when it ends), and an
    active request always runs its next step, hence the floor of 1.
    """
    c_hat = np.asarray(c_hat, dtype=np.float64)
    return np.where(c_hat >= horizon, float(horizon), np.maximum(c_hat - elapsed, 1.0))


def tokens_since(now: np.ndarray, then: np.ndarray) -> np.ndarray:
    """Decode steps since each answer was asked for, counted in the request's own tokens:
    ``now - then`` (never negative), 0 where ``then`` is -1 (no answer)."""
    now, then = np.asarray(now, dtype=np.int64), np.asarray(then, dtype=np.int64)
    return np.where(then >= 0, np.maximum(now - then, 0), 0)
