"""Prometheus metrics of one app (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("balanceroute_http_requests_total", "HTTP requests",
                                ["endpoint", "method", "status"], registry=r)
        self.latency = Histogram(
            "balanceroute_http_request_duration_seconds", "HTTP request latency",
            ["endpoint", "method"], registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 2.5, 10),
        )
        self.ingested = Counter("balanceroute_observations_ingested_total",
                                "observations stored", registry=r)
        self.duplicates = Counter("balanceroute_observation_duplicates_total",
                                  "observations ignored as already stored", registry=r)
        self.items = Counter("balanceroute_contribution_items_total",
                             "contribution items answered", ["estimator"], registry=r)
        self.buckets = Gauge("balanceroute_exact_match_buckets", "ExactMatch buckets held",
                             registry=r)
        self.model_version = Gauge("balanceroute_model_version", "model version", registry=r)
        self.hit_rate = Gauge("balanceroute_exact_match_hit_rate",
                              "share of auto queries answered by ExactMatch", registry=r)
        self.ece = Gauge("balanceroute_calibration_ece", "expected calibration error of p_fin",
                         ["estimator"], registry=r)
        self.brier = Gauge("balanceroute_calibration_brier", "Brier score of p_fin",
                           ["estimator"], registry=r)
        self.drifted = Gauge("balanceroute_drifted", "1 while drift is flagged", registry=r)
        self.observations = Gauge("balanceroute_observations", "observations in the learners",
                                  registry=r)


def refresh_gauges(service, metrics: Metrics) -> None:
    """Gauges that mirror the service's state (``service``: a PredictorService)."""
    metrics.buckets.set(service.buckets)
    metrics.model_version.set(service.model_version)
    metrics.observations.set(service.observations)
    metrics.hit_rate.set(service.hit_rate)
    metrics.drifted.set(1.0 if service.drift.drifted else 0.0)


def refresh_calibration_gauges(report: dict, metrics: Metrics) -> None:
    if report["horizon"] is not None or report["window"] is not None:
        return  # gauges describe the unfiltered report
    for entry in report["estimators"]:
        if entry["scored"]:
            metrics.ece.labels(entry["estimator"]).set(entry["ece"])
            metrics.brier.labels(entry["estimator"]).set(entry["brier"])
