"""The one registry of estimators, read by the service, the schemas, calibration, the A/B
layer and the command line.

An entry names the estimator as the API knows it (``estimator`` in ``/v1/contributions``,
the calibration report), the A/B policy that routes BR-H with it (``brh-<name>``), and a
factory that builds a fresh, unfitted instance from the service's settings. Registration
order is the order of reports and listings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router_client.errors import BalanceRouteError

from ..settings import Settings
from .base import Estimator


class UnknownEstimatorError(BalanceRouteError, ValueError):
    """An estimator name that is not registered."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = known
        super().__init__(f"unknown estimator {name!r}; known: {', '.join(known)}")


@dataclass(frozen=True)
class EstimatorSpec:
    """A registered estimator.

    Attributes:
        name: the API name (``survival``, ``exact_match``, ...).
        factory: builds a fresh, unfitted instance from the settings.
        policy: the A/B policy that routes BR-H with it; ``brh-<name>`` unless given.
        description: one line for listings and the OpenAPI schema.
    """

    name: str
    factory: Callable[[Settings], Estimator]
    policy: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        if not self.name or self.name in ("auto", "prior", "oracle"):
            raise ValueError(f"{self.name!r} is reserved and cannot name an estimator")
        if not self.policy:
            object.__setattr__(self, "policy", f"brh-{self.name}")

    def build(self, settings: Settings | None = None) -> Estimator:
        return self.factory(settings if settings is not None else Settings())


_REGISTRY: dict[str, EstimatorSpec] = {}


def register_estimator(spec: EstimatorSpec) -> EstimatorSpec:
    """Add (or replace) an estimator; returns the spec."""
    _REGISTRY[spec.name] = spec
    return spec


def unregister_estimator(name: str) -> None:
    _REGISTRY.pop(name, None)


def estimator_specs() -> list[EstimatorSpec]:
    return list(_REGISTRY.values())


def estimator_names() -> list[str]:
    return list(_REGISTRY)


def estimator_spec(name: str) -> EstimatorSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownEstimatorError(name, estimator_names()) from None


def spec_for_policy(policy: str) -> EstimatorSpec | None:
    """The estimator behind a ``brh-*`` A/B policy name, if any."""
    for spec in _REGISTRY.values():
        if spec.policy == policy:
            return spec
    return None
