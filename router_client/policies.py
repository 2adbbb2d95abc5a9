"""Routing policies behind one interface: baselines and BalanceRoute.

Every policy implements :class:`Policy`: ``route(fleet, pool)`` returns the assignments of one
scheduling round. Baselines take the pool in arrival order and place each request on a worker
with a free slot until either runs out; they differ only in the worker they pick:

    random  uniformly among workers with a free slot
    rr      round-robin over workers, skipping full ones
    jsq     fewest active requests (vLLM's default), ties to the lower index
    p2c     two distinct workers sampled among those with a free slot; the lower KV-token load
    ltl     least KV-token load, ties to the lower index

``br0`` and ``brh-*`` are :class:`BalanceRoutePolicy` (two-stage admission). Randomized
policies own a ``numpy.random.Generator`` seeded at construction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from .admission import BalanceRouteParams, RoundStats, route_round
from .errors import ContractError, UnknownPolicyError
from .fleet import Assignment, FleetView, WaitingRequest


@dataclass
class Decision:
    """The assignments of one round and what the round did."""

    assignments: list[Assignment]
    stats: RoundStats = field(default_factory=RoundStats)


@runtime_checkable
class Policy(Protocol):
    """A routing policy. ``needs_predictions`` says whether it reads ``fleet.active_c_hat``."""

    @property
    def name(self) -> str: ...

    @property
    def needs_predictions(self) -> bool: ...

    def route(self, fleet: FleetView, pool: list[WaitingRequest]) -> Decision: ...


class _PickOnePolicy:
    """Base of the baselines: FIFO over the pool, one worker choice per request."""

    name = "base"
    needs_predictions = False

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def pick(self, free: np.ndarray, loads: np.ndarray, counts: np.ndarray) -> int:
        raise NotImplementedError

    def route(self, fleet: FleetView, pool: list[WaitingRequest]) -> Decision:
        free = fleet.free_slots.astype(np.int64).copy()
        loads = fleet.loads.astype(np.float64).copy()
        counts = fleet.active_counts.astype(np.int64).copy()
        out: list[Assignment] = []
        for index, request in enumerate(pool):
            if not (free > 0).any():
                break
            worker = self.pick(free, loads, counts)
            out.append(Assignment(index, worker))
            free[worker] -= 1
            counts[worker] += 1
            loads[worker] += request.prompt_tokens
        return Decision(out)


class RandomPolicy(_PickOnePolicy):
    name = "random"

    def pick(self, free: np.ndarray, loads: np.ndarray, counts: np.ndarray) -> int:
        return int(self.rng.choice(np.flatnonzero(free > 0)))


class RoundRobinPolicy(_PickOnePolicy):
    name = "rr"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.next_worker = 0

    def pick(self, free: np.ndarray, loads: np.ndarray, counts: np.ndarray) -> int:
        workers = free.shape[0]
        for step in range(workers):
            worker = (self.next_worker + step) % workers
            if free[worker] > 0:
                self.next_worker = (worker + 1) % workers
                return worker
        raise ContractError("pick called with no free slot")


class JSQPolicy(_PickOnePolicy):
    name = "jsq"

    def pick(self, free: np.ndarray, loads: np.ndarray, counts: np.ndarray) -> int:
        return int(np.argmin(np.where(free > 0, counts, np.iinfo(np.int64).max)))


class P2CPolicy(_PickOnePolicy):
    name = "p2c"

    def pick(self, free: np.ndarray, loads: np.ndarray, counts: np.ndarray) -> int:
        open_workers = np.flatnonzero(free > 0)
        if open_workers.size == 1:
            return int(open_workers[0])
        a, b = self.rng.choice(open_workers, size=2, replace=False)
        return int(a) if (loads[a], a) <= (loads[b], b) else int(b)


class LeastTokenLoadPolicy(_PickOnePolicy):
    name = "ltl"

    def pick(self, free: np.ndarray, loads: np.ndarray, counts: np.ndarray) -> int:
        return int(np.argmin(np.where(free > 0, loads, np.inf)))


class BalanceRoutePolicy:
    """BR-H (or BR-0 with ``params.horizon == 0``).

    Without predictions (``fleet.active_c_hat is None``) a BR-H policy routes the round as
    BR-0 with the same stage settings: the fallback needs no predictor. It is BR-0 as
    configured, guard included (``as_br0``: the paper's ``always`` unless ``guard`` is set), so
    that a fleet falling back runs the policy it would compare against; BR-H's own rounds
    that look ahead with gamma 0 keep BR-H's guard (see the README).
    """

    def __init__(self, name: str, params: BalanceRouteParams) -> None:
        self.name = name
        self.params = params
        self.needs_predictions = params.horizon > 0
        self._fallback = params.as_br0()
        # rounds in a row the guard idle has held each worker back (``params.patience``):
        # rounds this policy routes; a stretch with no request waiting is not a round
        self.waited = np.zeros(0, dtype=np.int64)

    def route(self, fleet: FleetView, pool: list[WaitingRequest]) -> Decision:
        params = self.params
        if params.horizon > 0 and fleet.active_c_hat is None:
            params = self._fallback
        if self.waited.shape[0] != fleet.workers:  # a new fleet: nobody has waited in it
            self.waited = np.zeros(fleet.workers, dtype=np.int64)
        assignments, stats = route_round(fleet, pool, params, waited=self.waited)
        waited = np.zeros_like(self.waited)
        if stats.waited:
            held = np.asarray(stats.waited)
            waited[held] = self.waited[held] + 1
        self.waited = waited
        return Decision(assignments, stats)


@dataclass(frozen=True)
class PolicySpec:
    """A registered policy.

    Attributes:
        name: the policy name; a name ending in ``-`` is a family (``brh-`` covers
            ``brh-survival``, ``brh-oracle``, ...: the suffix names the predictor, which is
            the composition root's business).
        factory: ``factory(name, seed, params)`` builds the policy.
        params_type: the parameters class it takes (``None``: it takes none).
        needs_predictions: whether it reads ``fleet.active_c_hat``.
        description: one line for listings.
    """

    name: str
    factory: Callable[[str, int, BalanceRouteParams], Policy]
    params_type: type | None = None
    needs_predictions: bool = False
    description: str = ""

    @property
    def family(self) -> bool:
        return self.name.endswith("-")


_POLICIES: dict[str, PolicySpec] = {}


def register_policy(spec: PolicySpec) -> PolicySpec:
    """Add (or replace) a policy; returns the spec."""
    _POLICIES[spec.name] = spec
    return spec


def policy_specs() -> list[PolicySpec]:
    return list(_POLICIES.values())


def policy_spec(name: str) -> PolicySpec:
    """The spec behind ``name``: an exact entry, else the family its prefix names."""
    spec = _POLICIES.get(name)
    if spec is not None and not spec.family:
        return spec
    for candidate in _POLICIES.values():
        if candidate.family and name.startswith(candidate.name) and len(name) > len(
                candidate.name):
            return candidate
    raise UnknownPolicyError(name, [p.name + ("<name>" if p.family else "")
                                    for p in _POLICIES.values()])


def baseline(cls: Callable[[int], Policy]) -> Callable[[str, int, BalanceRouteParams], Policy]:
    return lambda name, seed, params: cls(seed)


def _balance_route(name: str, seed: int, params: BalanceRouteParams) -> Policy:
    return BalanceRoutePolicy(name, params)


def _br0(name: str, seed: int, params: BalanceRouteParams) -> Policy:
    return BalanceRoutePolicy(name, params.as_br0() if params.horizon else params)


for _spec in (
    PolicySpec("random", baseline(RandomPolicy), description="uniform among open workers"),
    PolicySpec("rr", baseline(RoundRobinPolicy), description="round-robin"),
    PolicySpec("jsq", baseline(JSQPolicy), description="fewest active requests"),
    PolicySpec("p2c", baseline(P2CPolicy), description="power of two choices on KV load"),
    PolicySpec("ltl", baseline(LeastTokenLoadPolicy), description="least KV-token load"),
    PolicySpec("br0", _br0, BalanceRouteParams, description="BalanceRoute, no prediction"),
    PolicySpec("brh", _balance_route, BalanceRouteParams, needs_predictions=True,
               description="BalanceRoute with lookahead (predictor chosen by the caller)"),
    PolicySpec("brh-", _balance_route, BalanceRouteParams, needs_predictions=True,
               description="BalanceRoute with lookahead, predictor named by the suffix"),
):
    register_policy(_spec)

def make_policy(name: str, seed: int = 0, params: BalanceRouteParams | None = None) -> Policy:
    """The policy called ``name``: a baseline, ``br0``, ``brh`` or ``brh-<estimator>``.

    ``params`` configures BR-0 and BR-H; baselines take none. The estimator part of a
    ``brh-*`` name is the composition root's business (which predictor feeds ``c_hat``);
    here every ``brh-*`` is BR-H with ``params``.
    """
    spec = policy_spec(name)
    return spec.factory(name, seed, params or BalanceRouteParams())
