"""Request and response bodies of the REST API (API.md)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import (
    Annotated,
    Literal,
    NotRequired,  # pydantic needs these on Python < 3.12
)

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator
from typing_extensions import TypedDict

from router_client.traces import key_of_text

# Lengths are bounded so that no input can blow up a learner's arrays or a 32-bit column.
MAX_TOKENS = 1_048_576
TokenCount = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKENS)]
RequestId = Annotated[str, Field(min_length=1, max_length=128)]
PromptKey = Annotated[str, Field(min_length=1, max_length=256)]


class _Keyed(BaseModel):
    """``prompt_key``, or the xxh3_64 hex of ``prompt`` (see :meth:`key`)."""

    model_config = ConfigDict(extra="forbid")

    prompt_key: PromptKey | None = None
    prompt: str | None = Field(None, repr=False, description="hashed, never stored or logged")

    def key(self) -> str | None:
        """The prompt key: the given one, else the hash of the text, else None."""
        if self.prompt_key is None and self.prompt is not None:
            return key_of_text(self.prompt)
        return self.prompt_key


class ObservationIn(_Keyed):
    request_id: RequestId
    prompt_tokens: TokenCount = 0
    output_tokens: TokenCount
    finish_reason: Literal["stop", "length", "cancelled", "error"] = "stop"
    completed_at: datetime | None = None

    @field_validator("completed_at")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)  # a naive time is taken as UTC
        return value


class ObservationsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    observations: list[ObservationIn] = Field(
        ..., description="at most BALANCEROUTE_MAX_OBSERVATIONS_PER_BATCH (default 10000)"
    )


class ObservationsOut(BaseModel):
    accepted: int
    duplicates: int


class ContributionItem(TypedDict):
    """An active request. TypedDicts, not models, on this hot path: validated straight from
    the JSON bytes into plain dicts, without building 1024 model instances per query."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]
    request_id: RequestId
    prompt_key: NotRequired[PromptKey | None]
    prompt: NotRequired[str | None]
    prompt_tokens: NotRequired[TokenCount]
    generated_tokens: TokenCount


class ContributionsIn(TypedDict):
    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]
    horizon: NotRequired[Annotated[int, Field(strict=True, ge=1, le=4096)] | None]
    estimator: NotRequired[Literal["auto", "survival", "exact_match"]]
    items: Annotated[list[ContributionItem], Field(
        description="at most BALANCEROUTE_MAX_ITEMS_PER_QUERY (default 65536)")]


CONTRIBUTIONS_IN = TypeAdapter(ContributionsIn)


def item_key(item: ContributionItem) -> str | None:
    """The prompt key of a contributions item: given, else the hash of the text."""
    key = item.get("prompt_key")
    text = item.get("prompt")
    if key is None and text is not None:
        return key_of_text(text)
    return key


class ContributionOut(BaseModel):
    request_id: str
    c_hat: float
    p_fin: float
    mu_rem: float | None
    estimator: str
    support: int


class ContributionsOut(BaseModel):
    horizon: int
    model_version: int
    drifted: bool
    items: list[ContributionOut]


class StatusOut(BaseModel):
    model_version: int
    observations: int
    buckets: int
    drifted: bool
    uptime_s: float


class TraceIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal["auto", "azure", "mooncake", "sharegpt", "csv"] = "auto"
    content: str = Field(..., min_length=1, description="the trace file's text")


class AbComparisonIn(BaseModel):
    """A simulated A/B comparison: the fields of ``balanceroute ab``."""

    model_config = ConfigDict(extra="forbid")
    policies: list[str] = Field(
        default_factory=lambda: ["jsq", "ltl", "br0", "brh-survival", "brh-oracle"],
        min_length=1, max_length=16)
    workers: list[Annotated[int, Field(strict=True, ge=1, le=256)]] = Field(
        default_factory=lambda: [8], min_length=1, max_length=8)
    batch: Annotated[int, Field(strict=True, ge=1, le=1024)] = 64
    load: float | Literal["backlog"] = 1.0
    seed: int = 0
    horizon: Annotated[int, Field(strict=True, ge=1, le=4096)] = 80
    refresh_steps: Annotated[int, Field(strict=True, ge=1, le=10_000)] = 10
    requests: Annotated[int, Field(strict=True, ge=1, le=200_000)] | None = None
    step_cost: tuple[Annotated[float, Field(ge=0)], Annotated[float, Field(ge=0)]] | None = None
    stage1: Literal["auto", "paper", "best-pair"] = "auto"
    source: Literal["observations"] | None = Field(
        None, description="replay the service's own stored observations")
    trace: TraceIn | None = None

    @field_validator("load")
    @classmethod
    def _positive(cls, value: float | str) -> float | str:
        if not isinstance(value, str) and not value > 0:
            raise ValueError("load must be > 0 or 'backlog'")
        return value

    @field_validator("policies")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        from .abtest import known_policies

        unknown = [p for p in value if p not in known_policies()]
        if unknown:
            raise ValueError(f"unknown policies {unknown}; known: {known_policies()}")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> AbComparisonIn:
        if (self.trace is None) == (self.source is None):
            raise ValueError("give exactly one of 'source' and 'trace'")
        return self


class AbJobOut(BaseModel):
    id: str
    status: Literal["queued", "running", "done", "failed"]
    progress: float
    results: list[dict]
    error: str | None
    created_at: str
    request: dict
