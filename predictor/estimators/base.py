"""The estimator protocol: what every estimator of remaining life implements.

Shaped like scikit-learn and lifelines estimators:

- ``__init__`` stores hyperparameters only;
- ``partial_fit(outcomes) -> self`` learns from a batch of finished requests;
  ``fit(outcomes)`` is ``reset()`` followed by ``partial_fit``;
- learned state ends in an underscore (``n_observed_``);
- ``predict(features, horizon) -> Estimate`` answers a batch of active requests; it never
  mutates what the estimator has learned (so shadow predictions cost nothing but time);
- optionally ``observe_running(features) -> self``: the requests running now, as
  right-censored evidence at their current age (see ``SurvivalEstimator``); callers that
  have the running set (the service at each query, the in-process predictor at each refresh)
  pass it before predicting.

Inputs are columns, not per-item objects: :class:`Features` holds ``prompt_tokens``,
``prompt_key`` and ``generated`` (plus ``extra`` columns for estimators that want more), and
:class:`Outcomes` the same admission-time features with each request's output length and
whether it was censored (cut by ``max_tokens``, cancelled or failed: at risk up to its length,
but not an end).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Self, runtime_checkable

import numpy as np

PRIOR = "prior"
UNKNOWN_TOKENS = -1  # a prompt length the caller did not give


class NotFittedError(RuntimeError):
    """A learned quantity was asked for before any observation."""


def _tokens(values: Sequence[int | None] | np.ndarray | None, n: int) -> np.ndarray:
    if values is None:
        return np.full(n, UNKNOWN_TOKENS, dtype=np.int64)
    if isinstance(values, np.ndarray):
        return values.astype(np.int64, copy=False)
    return np.fromiter((UNKNOWN_TOKENS if v is None else v for v in values), np.int64, n)


@dataclass(frozen=True)
class Features:
    """What is known about a batch of active requests, as columns of equal length.

    ``prompt_tokens`` is ``UNKNOWN_TOKENS`` (-1) where the caller did not say.
    """

    generated: np.ndarray
    prompt_key: Sequence[str | None]
    prompt_tokens: np.ndarray
    extra: Mapping[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def of(cls, generated: Sequence[int] | np.ndarray,
           prompt_key: Sequence[str | None] | None = None,
           prompt_tokens: Sequence[int | None] | np.ndarray | None = None) -> Features:
        generated = np.asarray(generated, dtype=np.int64)
        n = int(generated.shape[0])
        keys = list(prompt_key) if prompt_key is not None else [None] * n
        return cls(generated, keys, _tokens(prompt_tokens, n))

    def __len__(self) -> int:
        return int(self.generated.shape[0])

    def take(self, rows: Sequence[int] | np.ndarray) -> Features:
        rows = np.asarray(rows, dtype=np.int64)
        return Features(self.generated[rows], [self.prompt_key[i] for i in rows.tolist()],
                        self.prompt_tokens[rows], {k: v[rows] for k, v in self.extra.items()})


@dataclass(frozen=True)
class Outcomes:
    """Finished requests, as columns: admission-time features and what happened."""

    output_tokens: np.ndarray
    censored: np.ndarray
    prompt_key: Sequence[str | None]
    prompt_tokens: np.ndarray

    @classmethod
    def of(cls, output_tokens: Sequence[int] | np.ndarray,
           censored: Sequence[bool] | np.ndarray | None = None,
           prompt_key: Sequence[str | None] | None = None,
           prompt_tokens: Sequence[int | None] | np.ndarray | None = None) -> Outcomes:
        output_tokens = np.asarray(output_tokens, dtype=np.int64)
        n = int(output_tokens.shape[0])
        flags = (np.zeros(n, dtype=bool) if censored is None
                 else np.asarray(censored, dtype=bool))
        if flags.shape != output_tokens.shape:
            raise ValueError("output_tokens and censored must have the same length")
        keys = list(prompt_key) if prompt_key is not None else [None] * n
        if len(keys) != n:
            raise ValueError("prompt_key must have one entry per outcome")
        return cls(output_tokens, flags, keys, _tokens(prompt_tokens, n))

    def __len__(self) -> int:
        return int(self.output_tokens.shape[0])

    @property
    def events(self) -> np.ndarray:
        """True for an observed end, False for a censored one."""
        return ~self.censored


@dataclass(frozen=True)
class Estimate:
    """Batched answer: residual life, which estimator answered each item, and its support.

    ``c_hat`` in [0, H] is E[min(remaining, H)]; ``p_fin`` the probability of ending within
    H; ``mu_rem`` the mean remaining given that it does (NaN where ``p_fin`` is 0);
    ``source`` names what answered each item (the estimator itself, a fallback, or
    ``"prior"``); ``support`` how many observations stood behind the answer.
    """

    c_hat: np.ndarray
    p_fin: np.ndarray
    mu_rem: np.ndarray
    source: list[str]
    support: np.ndarray

    @classmethod
    def prior(cls, n: int, horizon: int) -> Estimate:
        """The conservative answer with nothing learned: ``c_hat = H``, ``p_fin = 0``."""
        return cls(np.full(n, float(horizon)), np.zeros(n), np.full(n, np.nan), [PRIOR] * n,
                   np.zeros(n, dtype=np.int64))


@runtime_checkable
class Estimator(Protocol):
    """An online estimator of expected capped remaining life."""

    name: str

    @property
    def n_observed_(self) -> int: ...

    def reset(self) -> Self: ...

    def partial_fit(self, outcomes: Outcomes) -> Self: ...

    def fit(self, outcomes: Outcomes) -> Self: ...

    def predict(self, features: Features, horizon: int) -> Estimate: ...


class BaseEstimator:
    """Shared plumbing: ``fit`` is ``reset`` plus ``partial_fit``."""

    name = "base"

    def reset(self) -> Self:
        raise NotImplementedError

    def partial_fit(self, outcomes: Outcomes) -> Self:
        raise NotImplementedError

    def fit(self, outcomes: Outcomes) -> Self:
        return self.reset().partial_fit(outcomes)


def observe_running(estimators: Iterable[Estimator], features: Features) -> None:
    """Tell each estimator that has ``observe_running`` about the requests running now (the
    one place the service, the in-process predictor and ``balanceroute calibrate`` do it)."""
    for estimator in estimators:
        running = getattr(estimator, "observe_running", None)
        if running is not None:
            running(features)
