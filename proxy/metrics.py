"""The proxy's Prometheus metrics (own registry; ``GET /metrics``).

Names start with ``balanceroute_proxy_``; the router's fallback switches and BR-H mode come from
:class:`router_client.fallback.RouterMetrics` in the same registry. Per-rank gauges and
imbalance are set from the mirrored state after every routing round and at every scrape.
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router_client.fallback import RouterMetrics

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0)
POOL_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.router = RouterMetrics(r)
        self.rank_kv = Gauge("balanceroute_proxy_rank_kv_tokens",
                             "KV tokens per decode rank (mirrored state)", ["rank"], registry=r)
        self.rank_active = Gauge("balanceroute_proxy_rank_active",
                                 "active requests per decode rank (mirrored)", ["rank"],
                                 registry=r)
        self.rank_up = Gauge("balanceroute_proxy_rank_up", "1 while the rank is routable",
                             ["rank"], registry=r)
        self.engine_running = Gauge("balanceroute_proxy_engine_requests",
                                    "running + waiting requests the engine's /metrics reports",
                                    ["rank"], registry=r)
        self.imbalance_maxmin = Gauge("balanceroute_proxy_imbalance_maxmin_tokens",
                                      "max_g L_g - min_g L_g over up ranks", registry=r)
        self.imbalance_total = Gauge("balanceroute_proxy_imbalance_total_tokens",
                                     "I(k) = G * max_g L_g - sum_g L_g over up ranks",
                                     registry=r)
        self.pool_depth = Gauge("balanceroute_proxy_pool_depth",
                                "requests waiting in the prompt pool", registry=r)
        self.round_pool = Histogram("balanceroute_proxy_round_pool_requests",
                                    "requests waiting in the pool as a routing round with a "
                                    "free slot starts: the choice the router had (a router "
                                    "that sees one or two at a time places them as they come)",
                                    buckets=POOL_BUCKETS, registry=r)
        self.pool_wait = Histogram("balanceroute_proxy_pool_wait_seconds",
                                   "time from joining the pool to dispatch",
                                   buckets=WAIT_BUCKETS, registry=r)
        self.pool_expired = Counter("balanceroute_proxy_pool_expired_total",
                                    "pool entries expired by the TTL", registry=r)
        self.pool_rejected = Counter("balanceroute_proxy_pool_rejected_total",
                                     "requests refused because the pool was full", registry=r)
        self.admissions = Counter("balanceroute_proxy_admissions_total",
                                  "dispatches by admission stage", ["stage"], registry=r)
        self.guard = Counter("balanceroute_proxy_guard_admissions_total",
                             "starvation-guard admissions", registry=r)
        self.guard_waits = Counter("balanceroute_proxy_guard_waits_total",
                                   "ranks the guard idle left with empty slots, one per rank "
                                   "and round", registry=r)
        self.patience = Counter("balanceroute_proxy_guard_patience_admissions_total",
                                "guard admissions of ranks the guard idle would have held "
                                "back longer than --patience rounds", registry=r)
        self.router_latency = Histogram("balanceroute_proxy_router_seconds",
                                        "one routing round (RouterClient.tick)",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.stage_latency = Histogram("balanceroute_proxy_router_stage_seconds",
                                       "time per admission stage in a round", ["stage"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.gamma = Gauge("balanceroute_proxy_brh_gamma",
                           "BR-H's per-step discount in the last round that used predictions "
                           "(with gamma 'turnover' it follows the fleet's turnover)",
                           registry=r)
        self.prompt_factor = Gauge("balanceroute_proxy_prompt_tokens_factor",
                                   "engine-reported prompt tokens per estimated token, learned "
                                   "from finished requests (1 until 20; without --tokenizer)",
                                   registry=r)
        self.prompt_factor.set(1.0)
        self.fallback_rounds = Counter("balanceroute_proxy_fallback_rounds_total",
                                       "BR-H rounds routed as BR-0 (no usable predictions)",
                                       registry=r)
        self.requests = Counter("balanceroute_proxy_requests_total",
                                "requests by how they ended", ["outcome"], registry=r)
        self.engine_errors = Counter("balanceroute_proxy_engine_errors_total",
                                     "failed calls to a rank", ["rank", "kind"], registry=r)
        self.ghosts = Counter("balanceroute_proxy_reconciled_ghosts_total",
                              "mirrored requests dropped by reconciliation", registry=r)

    def set_fleet(self, loads: np.ndarray, counts: np.ndarray, up: list[bool]) -> None:
        for g, (load, count) in enumerate(zip(loads.tolist(), counts.tolist(), strict=True)):
            self.rank_kv.labels(str(g)).set(load)
            self.rank_active.labels(str(g)).set(count)
            self.rank_up.labels(str(g)).set(1.0 if up[g] else 0.0)
        live = loads[np.asarray(up, dtype=bool)] if any(up) else loads
        if live.size:
            top = float(live.max())
            self.imbalance_maxmin.set(top - float(live.min()))
            self.imbalance_total.set(live.size * top - float(live.sum()))
