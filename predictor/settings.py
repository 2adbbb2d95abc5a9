"""Service settings from the environment (prefix ``BALANCEROUTE_``), see the README."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .asgi import BODY_BUDGET, BODY_LIMIT, MIN_BODY_LIMIT


class Settings(BaseSettings):
    """Every setting of the prediction service.

    ``history``: how many of the most recent observations the estimates weigh (a sliding
    window; ``0`` = every stored observation, plain Kaplan-Meier). 5000 is a few minutes of a
    busy fleet's completions: enough for a stable curve up to the upper percentiles, short
    enough that a workload change is forgotten after 5000 new completions.
    ``auto_estimator``: the registered estimator that answers ``estimator: "auto"`` queries
    (and whose loss the drift detector watches).
    ``exact_match_min_support``: a prompt key's bucket answers once it holds this many
    observations (1: the blend with the global curve takes care of thin buckets).
    ``exact_match_prior_weight``: the weight ``k`` (in observations) of the global curve in a
    key's blend until it can be estimated (``exact_match_estimate_weight``: by empirical Bayes,
    see :mod:`predictor.estimators.exact_match`).
    ``hazard_refit_every``: at most this many new observations between two fits of the hazard
    model (on the most recent ``history`` observations, 5000 when ``history`` is 0).
    ``calibration_sample_rate``: share of contribution items whose predictions are kept for
    scoring (deterministic by request and tokens generated); ``calibration_capacity``: scored
    predictions kept (memory and database); ``drift_length_effect``, ``drift_loss_effect``,
    ``drift_clear_after``: the detectors' minimum effects and the hysteresis of the drift flag
    (see :mod:`predictor.calibration`).
    """

    model_config = SettingsConfigDict(env_prefix="BALANCEROUTE_", extra="ignore")

    database_url: str = "sqlite:///./balanceroute.db"
    api_token: str | None = None
    default_horizon: int = Field(80, ge=1, le=4096)
    auto_estimator: str = "exact_match"
    estimators: str | None = Field(
        None, description="comma-separated registered estimators the service runs (default: "
        "all); e.g. 'survival,exact_match' leaves out the hazard model's fits")
    exact_match_min_support: int = Field(1, ge=1)
    exact_match_prior_weight: float = Field(1.0, ge=0.0)
    exact_match_estimate_weight: bool = True
    hazard_refit_every: int = Field(1000, ge=1)
    hazard_fit_process: bool = Field(
        True, description="fit the hazard model in a process of its own (spawned at the "
        "first fit, about 175 MB), so that queries do not share the interpreter with its fits; "
        "false: on a thread of the service")
    history: int = Field(5000, ge=0)
    survival_tail_at_risk: int = Field(
        50, ge=0, description="the Kaplan-Meier curves' thin tail (fewer requests at risk than "
        "this, at most a tenth of the sample) gets one pooled hazard; 0: plain Kaplan-Meier")
    exact_match_max_buckets: int = Field(100_000, ge=1)
    exact_match_bucket_window: int = Field(256, ge=1)
    exact_match_max_bytes: int = Field(
        64 << 20, ge=1 << 16, description="bytes the prompt keys' outcomes may take (least "
        "recently updated keys evicted first)")
    exact_match_cache_bytes: int = Field(
        16 << 20, ge=1 << 16, description="bytes of per-key curves cached for queries")
    max_observations_per_batch: int = Field(10_000, ge=1)
    ingest_concurrency: int = Field(
        2, ge=1, description="observation bodies and uploaded traces parsed (and observations "
        "ingested) at once; the others wait, already read (parsed, a body takes many times its "
        "bytes)")
    max_items_per_query: int = Field(65_536, ge=1)
    max_body_bytes: int = Field(BODY_LIMIT, ge=MIN_BODY_LIMIT)
    max_inflight_body_bytes: int | None = Field(
        None, ge=MIN_BODY_LIMIT, description="bytes of request bodies held at once (read, not "
        "yet answered; one client address a quarter of it); 503 with Retry-After beyond; "
        f"default {BODY_BUDGET}, or max_body_bytes if larger; at least max_body_bytes")
    calibration_sample_rate: float = Field(0.1, ge=0.0, le=1.0)
    calibration_max_pending: int = Field(200_000, ge=1)
    calibration_max_pending_per_caller: int | None = Field(
        None, ge=1, description="pending predictions one caller (client address) may hold; "
        "default a quarter of calibration_max_pending")
    calibration_capacity: int = Field(200_000, ge=1)
    drift_length_effect: float = Field(0.3, gt=0.0, le=1.0)
    drift_loss_effect: float = Field(0.05, gt=0.0, le=1.0)
    replay_observations: int = Field(
        20_000, ge=0, description="newest observations a restart replays in full (older ones "
        "only for the prompt keys' newest outcomes); 0: every stored observation")
    snapshot_every: int = Field(
        100_000, ge=0, description="observations between two snapshots of the learners' "
        "per-key state written to the database (a restart reads the newest and the rows after "
        "it instead of every stored row); 0: none")
    replica_poll_interval: float = Field(
        1.0, ge=0.0, le=3600.0, description="seconds between two reads of the observations "
        "table for what other replicas ingested (0: never)")
    max_queued_jobs: int = Field(8, ge=1, le=1000)
    drift_clear_after: int = Field(5000, ge=1)

    @model_validator(mode="after")
    def _budget_holds_a_body(self) -> Settings:
        if self.max_inflight_body_bytes is not None and \
                self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError("max_inflight_body_bytes must be at least max_body_bytes")
        return self
