"""Shadow mode: run BR-0/BR-H beside the policy in use and record what they would have done.

:class:`ShadowPolicy` routes with ``primary`` (its decisions are the ones applied) and, on the
very same fleet view and pool, asks each shadow policy for its decision. For every round it
records each policy's assignments and the imbalance they predict right after admission
(max-min and ``G * max - sum`` of the current loads plus the admitted prompts), for offline
comparison before switching. ``summary()`` gives the mean predicted imbalance per policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .fleet import FleetView, WaitingRequest
from .policies import Decision, Policy


@dataclass(frozen=True)
class ShadowRecord:
    round: int
    policy: str
    assignments: tuple[tuple[str, int], ...]  # (request id, worker)
    predicted_maxmin: float
    predicted_total: float
    used: bool


def predicted_imbalance(fleet: FleetView, pool: list[WaitingRequest],
                        decision: Decision) -> tuple[float, float]:
    loads = fleet.loads.astype(np.float64).copy()
    for a in decision.assignments:
        loads[a.worker] += pool[a.pool_index].prompt_tokens
    return float(loads.max() - loads.min()), float(loads.size * loads.max() - loads.sum())


@dataclass
class ShadowPolicy:
    primary: Policy
    shadows: list[Policy]
    records: list[ShadowRecord] = field(default_factory=list)
    rounds: int = 0

    @property
    def name(self) -> str:
        return self.primary.name

    @property
    def needs_predictions(self) -> bool:
        return self.primary.needs_predictions or any(s.needs_predictions for s in self.shadows)

    def route(self, fleet: FleetView, pool: list[WaitingRequest]) -> Decision:
        primary_fleet = fleet if self.primary.needs_predictions else _without_predictions(fleet)
        used = self.primary.route(primary_fleet, pool)
        self._record(fleet, pool, self.primary.name, used, True)
        for shadow in self.shadows:
            view = fleet if shadow.needs_predictions else _without_predictions(fleet)
            self._record(fleet, pool, shadow.name, shadow.route(view, pool), False)
        self.rounds += 1
        return used

    def _record(self, fleet: FleetView, pool: list[WaitingRequest], name: str,
                decision: Decision, used: bool) -> None:
        maxmin, total = predicted_imbalance(fleet, pool, decision)
        pairs = tuple((str(pool[a.pool_index].request_id), a.worker)
                      for a in decision.assignments)
        self.records.append(ShadowRecord(self.rounds, name, pairs, maxmin, total, used))

    def summary(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for name in dict.fromkeys(r.policy for r in self.records):
            mine = [r for r in self.records if r.policy == name]
            out[name] = {"rounds": len(mine),
                         "predicted_maxmin_mean": float(np.mean([r.predicted_maxmin
                                                                 for r in mine])),
                         "predicted_total_mean": float(np.mean([r.predicted_total
                                                                for r in mine]))}
        return out


def _without_predictions(fleet: FleetView) -> FleetView:
    if fleet.active_c_hat is None:
        return fleet
    return replace(fleet, active_c_hat=None, pool_c_hat=None, active_p_fin=None,
                   active_mu_rem=None)
