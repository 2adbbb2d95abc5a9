"""When BR-H may use predictions, and when it must fall back to BR-0.

After every refresh the router tells the controller whether the predictor answered usefully.
A failed refresh (timeout, error, unreachable) or an answer flagged ``drifted`` switches to BR-0
at once: the very next round routes without predictions. Returning to BR-H takes
``healthy_to_return`` consecutive healthy refreshes (default 3), so a flapping service does not
make the router flap. Every switch is logged, kept in ``switches`` and counted in Prometheus.
The gauge ``balanceroute_router_brh_active`` is 1 while BR-H uses predictions: 0 until the
first refresh says it may (so 0 for ever on a router that runs BR-0 or a baseline), and 0
while the router follows the service's recommendation to run BR-0 (:meth:`advise_br0`; the
router still asks the service, for its next recommendation).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("balanceroute.router")

BRH = "brh"
BR0 = "br0"


@dataclass(frozen=True)
class Switch:
    step: int
    to: str
    reason: str


class RouterMetrics:
    """Router-side Prometheus metrics (own registry unless one is given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.switches = Counter("balanceroute_router_fallback_switches_total",
                                "switches between BR-H and BR-0", ["to", "reason"],
                                registry=self.registry)
        self.mode = Gauge("balanceroute_router_brh_active", "1 while BR-H uses predictions",
                          registry=self.registry)
        self.refresh_failures = Counter("balanceroute_router_refresh_failures_total",
                                        "prediction refreshes that failed", ["reason"],
                                        registry=self.registry)


@dataclass
class FallbackController:
    healthy_to_return: int = 3
    metrics: RouterMetrics | None = None
    mode: str = BRH
    healthy_streak: int = 0
    switches: list[Switch] = field(default_factory=list)
    healthy: bool = False  # the last refresh's verdict: predictions may be used
    advised_br0: bool = False  # the router runs BR-0 on the service's recommendation

    def __post_init__(self) -> None:
        if self.healthy_to_return < 1:
            raise ValueError("healthy_to_return must be >= 1")
        if self.metrics:
            self.metrics.mode.set(0.0)  # nothing used yet, whatever the mode allows

    def on_refresh(self, step: int, healthy: bool, reason: str = "ok") -> bool:
        """Record a refresh outcome; returns whether BR-H may use predictions now."""
        if healthy:
            self.healthy_streak += 1
            if self.mode == BR0 and self.healthy_streak >= self.healthy_to_return:
                self._switch(step, BRH, f"{self.healthy_streak} healthy refreshes")
        else:
            self.healthy_streak = 0
            if self.metrics:
                self.metrics.refresh_failures.labels(reason).inc()
            if self.mode == BRH:
                self._switch(step, BR0, reason)
        self.healthy = self.mode == BRH
        self._publish()
        return self.healthy

    def warming(self) -> None:
        """The predictor has no answer yet (not a failure: no switch): predictions unused."""
        self.healthy = False
        self._publish()

    def advise_br0(self, br0: bool) -> None:
        """The router runs BR-0 on the service's recommendation (True), or BR-H again (False):
        BR-H then uses no predictions, whatever the refreshes say."""
        self.advised_br0 = br0
        self._publish()

    def _publish(self) -> None:
        if self.metrics:
            self.metrics.mode.set(1.0 if self.healthy and not self.advised_br0 else 0.0)

    def _switch(self, step: int, to: str, reason: str) -> None:
        self.mode = to
        self.switches.append(Switch(step, to, reason))
        log.warning("router switches to %s at step %d: %s", to.upper(), step, reason)
        if self.metrics:
            self.metrics.switches.labels(to, reason.split(":")[0]).inc()
