"""The committed Grafana dashboard loads, and every series it queries is one we export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from predictor.metrics import Metrics
from proxy.metrics import ProxyMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json"
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created")}


def exported_series() -> set[str]:
    """Every sample name the proxy's and the service's registries can produce."""
    names = set()
    for registry in (ProxyMetrics().registry, Metrics().registry):
        for family in registry.collect():
            names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def test_dashboard_is_a_grafana_dashboard_whose_queries_name_exported_series():
    board = json.loads(DASHBOARD.read_text())
    assert board["title"] and board["uid"] and isinstance(board["schemaVersion"], int)
    panels = board["panels"]
    assert panels
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    exported = exported_series()
    queried: set[str] = set()
    for panel in panels:
        assert panel["title"] and panel["gridPos"]["w"] > 0 and panel["gridPos"]["h"] > 0
        assert panel["targets"], f"panel {panel['title']!r} queries nothing"
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            queried.update(re.findall(r"\bbalanceroute_[a-z0-9_]+", target["expr"]))
    assert queried, "the dashboard queries none of our metrics"
    unknown = sorted(queried - exported)
    assert not unknown, f"the dashboard queries series nobody exports: {unknown}"
    # The list: per-rank load and count, imbalance, pool, router latency, fallback,
    # and the service's calibration.
    for wanted in ("balanceroute_proxy_rank_kv_tokens", "balanceroute_proxy_rank_active",
                   "balanceroute_proxy_imbalance_maxmin_tokens", "balanceroute_proxy_pool_depth",
                   "balanceroute_proxy_router_stage_seconds_bucket",
                   "balanceroute_router_fallback_switches_total",
                   "balanceroute_calibration_ece"):
        assert wanted in queried, wanted
