"""Request and response bodies of the REST API (see the README)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from itertools import islice
from typing import (
    Annotated,
    Literal,
    NotRequired,  # pydantic needs these on Python < 3.12
    TypeVar,
)

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from typing_extensions import TypedDict

from router_client.admission import (
    BalanceRouteParams,
    GuardRule,
    ShortPoolGrowth,
    ShortPoolRule,
    Stage1Rule,
    Stage2Order,
    ZeroGammaRules,
)
from router_client.errors import ParameterError
from router_client.simulator import (
    MAX_LOAD,
    MIN_LOAD,
    STEP_COST_MAX,
    STEP_COST_MIN,
    check_load,
    check_step_cost,
)
from router_client.traces import key_of_text

from .estimators import estimator_names
from .tuning import MIN_GAIN, learners_of

# Lengths are bounded so that no input can blow up a learner's arrays or a 32-bit column.
MAX_TOKENS = 1_048_576
TokenCount = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKENS)]


def storable(text: str) -> str:
    """Text every database stores: no NUL (PostgreSQL refuses it) and no lone surrogate (not
    encodable as UTF-8)."""
    if "\x00" in text:
        raise ValueError("must not contain a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (a lone surrogate is not)") from None
    return text


# The bounds of the text fields, and the same with the ``storable`` check (the contributions
# fast path, below, skips the check only where it cannot fail).
RequestIdText = Annotated[str, Field(min_length=1, max_length=128)]
PromptKeyText = Annotated[str, Field(min_length=1, max_length=256)]
RequestId = Annotated[RequestIdText, AfterValidator(storable)]
PromptKey = Annotated[PromptKeyText, AfterValidator(storable)]
PromptText = Annotated[str, AfterValidator(storable)]
Horizon = Annotated[int, Field(strict=True, ge=1, le=4096)]


def _timestamp_text(value: object) -> object:
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError("must be an ISO 8601 date-time string, not a number")
    return value


def known_estimator(name: str) -> str:
    """``auto`` or a registered estimator (read at validation time, so an estimator
    registered after import is accepted)."""
    known = ["auto", *estimator_names()]
    if name not in known:
        raise ValueError(f"unknown estimator {name!r}; known: {', '.join(known)}")
    return name


EstimatorName = Annotated[str, AfterValidator(known_estimator), Field(
    description="`auto` (the service's default estimator: BALANCEROUTE_AUTO_ESTIMATOR) or a "
    "registered estimator: `survival`, `exact_match` and any added to the registry")]


# Unknown fields. ``extra="forbid"`` makes one error per unknown key, so one body of a few
# million made-up keys (within the size limit) once took gigabytes and a minute to refuse,
# with a 280 MB answer. Every body is read with unknown keys let in (the schemas still
# document none) and refused with one error per object that has any (:class:`_Closed`; the
# contributions bodies, TypedDicts on the hot path, in :func:`check_known_fields`), naming at
# most ``UNKNOWN_LISTED``; lists stop at their first bad entry (``fail_fast``). So a bad body
# costs about what a good one of its size does.
_OPEN = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})
L = TypeVar("L")
FailFast = Annotated[L, Field(fail_fast=True)]
UNKNOWN_LISTED = 10


class _Closed(BaseModel):
    """A body object with no unknown field: one ``extra_forbidden`` error naming the first
    ``UNKNOWN_LISTED`` of them if it has any (``ctx``: ``fields``, and how many ``more``; the
    422 lists each at its own location, as ``extra="forbid"`` does: see
    :func:`unknown_field_errors`)."""

    model_config = _OPEN

    @model_validator(mode="after")
    def _no_unknown_fields(self) -> _Closed:
        extra = self.__pydantic_extra__
        if extra:
            fields = list(islice(extra, UNKNOWN_LISTED))
            more = len(extra) - len(fields)
            raise PydanticCustomError(
                "extra_forbidden", "Extra inputs are not permitted: {listed}",
                {"listed": ", ".join(map(repr, fields)) + (f" and {more} more" if more else ""),
                 "fields": fields, "more": more})
        return self


def unknown_field_errors(error: dict) -> list[dict]:
    """A :class:`_Closed` object's one ``extra_forbidden`` error (``loc``, ``msg``, ``type``,
    ``ctx``) as ``extra="forbid"`` words it: one error at each field it names, then one
    counting those not named; any other error as it is."""
    ctx = error.get("ctx") or {}
    if error.get("type") != "extra_forbidden" or "fields" not in ctx:
        return [error]
    loc = list(error["loc"])
    out = [{"type": "extra_forbidden", "loc": [*loc, field], "msg": "Extra inputs are not "
            "permitted"} for field in ctx["fields"]]
    if ctx.get("more"):
        out.append({"type": "extra_forbidden", "loc": loc,
                    "msg": f"{ctx['more']} more unknown fields, not listed"})
    return out


class _Keyed(_Closed):
    """``prompt_key``, or the xxh3_64 hex of ``prompt`` (see :meth:`key`)."""

    prompt_key: PromptKey | None = None
    prompt: PromptText | None = Field(None, repr=False,
                                      description="hashed, never stored or logged")

    def key(self) -> str | None:
        """The prompt key: the given one, else the hash of the text, else None."""
        return prompt_key_of(self.prompt_key, self.prompt)


class ObservationIn(_Keyed):
    request_id: RequestId
    prompt_tokens: TokenCount | None = Field(
        None, description="prompt length in tokens; null or absent when unknown")
    output_tokens: TokenCount
    finish_reason: Literal["stop", "length", "cancelled", "error"] = "stop"
    completed_at: Annotated[datetime | None, BeforeValidator(_timestamp_text)] = Field(
        None, description="ISO 8601; a naive time is taken as UTC; default: now")

    @field_validator("completed_at")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)  # a naive time is taken as UTC
        return value


class ObservationsIn(_Closed):
    observations: list[ObservationIn] = Field(
        ..., fail_fast=True,
        description="at most BALANCEROUTE_MAX_OBSERVATIONS_PER_BATCH (default 10000)")


class ObservationsOut(BaseModel):
    accepted: int = Field(description="observations stored by this call")
    duplicates: int = Field(description="observations whose request_id was already stored "
                            "(or repeated in the batch): counted once, never twice")


class ContributionItem(TypedDict):
    """An active request. TypedDicts, not models, on this hot path: validated straight from
    the JSON bytes into plain dicts, without building 1024 model instances per query."""

    __pydantic_config__ = _OPEN  # type: ignore[misc]
    request_id: RequestId
    prompt_key: NotRequired[PromptKey | None]
    prompt: NotRequired[PromptText | None]
    prompt_tokens: NotRequired[TokenCount]
    generated_tokens: TokenCount


class ContributionColumns(TypedDict):
    """The same active requests as ``items``, one array per field (entry ``i`` of every array
    is request ``i``): about half the bytes of ``items`` and several times cheaper to parse,
    on both sides. Every array given must have as many entries as ``request_id``; ``null``
    in ``prompt_key``, ``prompt`` or ``prompt_tokens`` is that request's field left out."""

    __pydantic_config__ = _OPEN  # type: ignore[misc]
    request_id: FailFast[list[RequestId]]
    prompt_key: NotRequired[FailFast[list[PromptKey | None]]]
    prompt: NotRequired[FailFast[list[PromptText | None]]]
    prompt_tokens: NotRequired[FailFast[list[TokenCount | None]]]
    generated_tokens: FailFast[list[TokenCount]]


class ContributionsIn(TypedDict):
    """``items`` or ``columns`` (exactly one); the answer comes in the same layout."""

    __pydantic_config__ = _OPEN  # type: ignore[misc]
    horizon: NotRequired[Horizon | None]
    estimator: NotRequired[EstimatorName]
    items: NotRequired[Annotated[list[ContributionItem], Field(
        fail_fast=True, description="at most BALANCEROUTE_MAX_ITEMS_PER_QUERY (default 65536)")]]
    columns: NotRequired[Annotated[ContributionColumns, Field(
        description="the items as one array per field; at most "
                    "BALANCEROUTE_MAX_ITEMS_PER_QUERY entries")]]


CONTRIBUTIONS_IN = TypeAdapter(ContributionsIn)


# The same body without the ``storable`` check on its strings. A NUL or a lone surrogate can
# reach a string only through a ``\u`` escape (the JSON parser refuses raw control characters
# and bytes that are not UTF-8), so a body with no ``\u`` in it needs no such check: the
# check is a Python call per string, about 0.8 ms of a 1,024-item query.
class _PlainContributionItem(TypedDict):
    __pydantic_config__ = _OPEN  # type: ignore[misc]
    request_id: RequestIdText
    prompt_key: NotRequired[PromptKeyText | None]
    prompt: NotRequired[str | None]
    prompt_tokens: NotRequired[TokenCount]
    generated_tokens: TokenCount


class _PlainContributionColumns(TypedDict):
    __pydantic_config__ = _OPEN  # type: ignore[misc]
    request_id: FailFast[list[RequestIdText]]
    prompt_key: NotRequired[FailFast[list[PromptKeyText | None]]]
    prompt: NotRequired[FailFast[list[str | None]]]
    prompt_tokens: NotRequired[FailFast[list[TokenCount | None]]]
    generated_tokens: FailFast[list[TokenCount]]


class _PlainContributionsIn(TypedDict):
    __pydantic_config__ = _OPEN  # type: ignore[misc]
    horizon: NotRequired[Horizon | None]
    estimator: NotRequired[EstimatorName]
    items: NotRequired[FailFast[list[_PlainContributionItem]]]
    columns: NotRequired[_PlainContributionColumns]


_PLAIN_CONTRIBUTIONS_IN = TypeAdapter(_PlainContributionsIn)


def parse_contributions(raw: bytes) -> ContributionsIn:
    """``CONTRIBUTIONS_IN.validate_json(raw)``, faster for a body without ``\\u`` escapes
    (the usual one): the same value, and the same ``ValidationError`` for a bad body (its
    errors come from ``CONTRIBUTIONS_IN`` itself)."""
    if b"\\u" not in raw:
        try:
            body = _PLAIN_CONTRIBUTIONS_IN.validate_json(raw)
        except ValidationError:
            pass  # the errors are reported as the full schema words them
        else:
            return check_known_fields(body)
    return check_known_fields(CONTRIBUTIONS_IN.validate_json(raw))


def _unknown_keys(known: frozenset[str], value: dict, loc: tuple, found: list[tuple]) -> int:
    """How many keys of ``value`` are not ``known``; the locations of the first ones go to
    ``found``, up to ``UNKNOWN_LISTED`` in all."""
    unknown = len(value) - len(known.intersection(value))
    for key in value:
        if len(found) >= UNKNOWN_LISTED:
            break
        if key not in known:
            found.append((*loc, key))
    return unknown


def _keys(typed_dict: type) -> frozenset[str]:
    return frozenset(typed_dict.__required_keys__ | typed_dict.__optional_keys__)  # type: ignore[attr-defined]


_BODY_KEYS, _COLUMN_KEYS, _ITEM_KEYS = (
    _keys(ContributionsIn), _keys(ContributionColumns), _keys(ContributionItem))


def check_known_fields(body: ContributionsIn) -> ContributionsIn:
    """``body`` if it has no field the schema does not know; else a ``ValidationError`` with an
    ``extra_forbidden`` error at each of the first ``UNKNOWN_LISTED`` (as ``extra="forbid"``
    words them) and one counting the rest."""
    found: list[tuple] = []
    unknown = _unknown_keys(_BODY_KEYS, body, (), found)  # type: ignore[arg-type]
    columns = body.get("columns")
    if columns is not None:
        unknown += _unknown_keys(_COLUMN_KEYS, columns, ("columns",), found)  # type: ignore[arg-type]
    items = body.get("items") or ()
    if not all(map(_ITEM_KEYS.issuperset, items)):  # C-speed; the loop only on a bad body
        for number, item in enumerate(items):
            if not _ITEM_KEYS.issuperset(item):
                unknown += _unknown_keys(_ITEM_KEYS, item, ("items", number), found)  # type: ignore[arg-type]
    if not unknown:
        return body
    errors: list[InitErrorDetails] = [{"type": "extra_forbidden", "loc": loc, "input": None}
                                      for loc in found]
    if unknown > len(found):
        errors.append({"type": PydanticCustomError(
            "extra_forbidden", "{more} more unknown fields, not listed",
            {"more": unknown - len(found)}), "loc": (), "input": None})
    raise ValidationError.from_exception_data("ContributionsIn", errors)


def prompt_key_of(key: str | None, text: str | None) -> str | None:
    """A request's prompt key: the given one, else the hash of its prompt's text, else None
    (observations, contribution items and columns alike)."""
    if key is None and text is not None:
        return key_of_text(text)
    return key


def item_key(item: ContributionItem) -> str | None:
    """The prompt key of a contributions item: given, else the hash of the text."""
    return prompt_key_of(item.get("prompt_key"), item.get("prompt"))


class ContributionOut(BaseModel):
    request_id: str = Field(description="as given, items keep their order")
    c_hat: float = Field(description="E[min(remaining tokens, H) | generated so far], in [0, H]")
    p_fin: float = Field(description="probability of ending within H more tokens")
    mu_rem: float | None = Field(description="mean remaining tokens given that the request "
                                 "ends within H; null when p_fin is 0")
    estimator: str = Field(description="what answered this item: the estimator asked for, its "
                           "fallback (`survival`), or `prior` with nothing learned")
    support: int = Field(description="observations behind the answer (the key's bucket for "
                         "exact_match, the whole window for survival, 0 for the prior)")


class ContributionColumnsOut(BaseModel):
    """The answer's items as one array per field, in the query's order."""

    request_id: list[str]
    c_hat: list[float]
    p_fin: list[float]
    mu_rem: list[float | None]
    estimator: list[str]
    support: list[int]


class ContributionsOut(BaseModel):
    horizon: int = Field(description="H used for this answer")
    model_version: int = Field(description="batches of observations learned so far")
    drifted: bool = Field(description="drift is flagged: routers should fall back to BR-0")
    recommendation: Recommendation | None = Field(
        description="which policy routers should run, from the newest tuning (null: none yet)")
    items: list[ContributionOut] | None = Field(
        None, description="when the query gave items (left out otherwise)")
    columns: ContributionColumnsOut | None = Field(
        None, description="when the query gave columns (left out otherwise)")


class StatusOut(BaseModel):
    model_version: int = Field(description="batches of observations learned so far")
    observations: int = Field(description="observations learned")
    buckets: int = Field(description="per-prompt-key buckets held (ExactMatch)")
    drifted: bool = Field(description="drift is flagged")
    uptime_s: float = Field(description="seconds since the process started")
    estimators: list[str] = Field(description="the estimators this service runs")
    auto_estimator: str = Field(description="the estimator that answers `auto`")
    recommendation: Recommendation | None = Field(
        description="which policy routers should run, from the newest tuning (null: none yet)")
    fitting: bool = Field(description="deferred learning (the hazard model's fits, ExactMatch's "
                          "k estimates, on newly learned batches) is queued or running; "
                          "queries are slower meanwhile")


class ReliabilityBin(BaseModel):
    lo: float = Field(description="lower edge of the p_fin bin")
    hi: float = Field(description="upper edge of the p_fin bin")
    mean_pred: float | None = Field(description="mean predicted p_fin in the bin")
    observed: float | None = Field(description="share that ended within H in the bin")
    count: int = Field(description="scored predictions in the bin")


class EstimatorCalibration(BaseModel):
    estimator: str
    scored: int = Field(description="predictions scored against a reported outcome")
    brier: float | None = Field(description="mean squared error of p_fin")
    ece: float | None = Field(description="expected calibration error over 10 bins")
    bins: list[ReliabilityBin]
    mae_c_hat: float | None = Field(description="mean absolute error of c_hat against the "
                                    "realized min(remaining, H)")
    hit_rate: float | None = Field(description="share answered by the estimator itself, not a "
                                   "fallback")
    exact_match_hit_rate: float | None = Field(description="hit_rate, for exact_match only")


class DriftStream(BaseModel):
    drifted: bool
    samples: int
    detections: int
    since_sample: int | None


class DriftOut(BaseModel):
    drifted: bool = Field(description="a detector has flagged drift (with hysteresis)")
    detector: str | None = Field(description="which detectors are up")
    since: str | None = Field(description="time of the sample that raised the flag")
    streams: dict[str, DriftStream] = Field(default_factory=dict)


class CalibrationOut(BaseModel):
    horizon: int | None = Field(description="the horizon filter, if any")
    window: int | None = Field(description="the window filter, if any")
    estimators: list[EstimatorCalibration]
    pending: int = Field(description="sampled predictions waiting for their outcome")
    pending_dropped: int = Field(description="sampled predictions dropped unscored (bound)")
    sample_rate: float = Field(description="share of contribution items sampled for scoring")
    drift: DriftOut


class HealthOut(BaseModel):
    status: Literal["ok"]


class ReadyOut(BaseModel):
    status: Literal["ready", "not ready"]
    learner_loaded: bool
    database: bool


class TraceIn(_Closed):
    format: Literal["auto", "azure", "mooncake", "sharegpt", "burstgpt", "csv"] = "auto"
    content: str = Field(..., min_length=1, description="the trace file's text")


Workers = Annotated[int, Field(strict=True, ge=1, le=256)]


T = TypeVar("T")


def _checked(check: Callable[[T], None], value: T) -> T:
    """``value`` once the simulator's ``check`` accepts it (its ParameterError as pydantic's
    ValueError: the same message in the 422 as in the CLI)."""
    try:
        check(value)
    except ParameterError as exc:
        raise ValueError(str(exc)) from None
    return value


class ReplayIn(_Closed):
    """What every simulated replay takes (A/B comparisons and tunings)."""

    batch: Annotated[int, Field(strict=True, ge=1, le=1024)] = 64
    load: float | Literal["backlog"] = Field(
        1.0, description=f"arrivals as a share of the fleet's capacity, {MIN_LOAD:g} to "
        f"{MAX_LOAD:g}, or 'backlog' (the pool kept full)")
    seed: Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)] = 0
    refresh_steps: Annotated[int, Field(strict=True, ge=1, le=10_000)] = 10
    step_cost: tuple[Annotated[float, Field(ge=0, le=STEP_COST_MAX[0])],
                     Annotated[float, Field(ge=0, le=STEP_COST_MAX[1])]] | None = Field(
        None, description="A, B: a step lasts A * max load + B seconds (not both 0; each 0 or "
        f"at least {STEP_COST_MIN:g})")

    @field_validator("load", mode="before")
    @classmethod
    def _not_a_bool(cls, value: object) -> object:
        if isinstance(value, bool):  # JSON true is not a load
            raise ValueError("load must be a number or 'backlog'")
        return value

    @field_validator("load")
    @classmethod
    def _in_range(cls, value: float | str) -> float | str:
        return _checked(check_load, value)  # after conversion: "0" or "nan" as text too

    @field_validator("step_cost", mode="before")
    @classmethod
    def _no_bools(cls, value: object) -> object:
        if isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value):
            raise ValueError("step_cost takes two numbers, not true or false")
        return value

    @field_validator("step_cost")
    @classmethod
    def _not_both_zero(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        return value if value is None else _checked(check_step_cost, value)


class AbComparisonIn(ReplayIn):
    """A simulated A/B comparison: the fields of ``balanceroute ab``."""

    policies: list[str] = Field(
        default_factory=lambda: ["jsq", "ltl", "br0", "brh-survival", "brh-oracle"],
        min_length=1, max_length=16)
    workers: list[Workers] = Field(default_factory=lambda: [8], min_length=1, max_length=8)
    horizon: Horizon = 80
    requests: Annotated[int, Field(strict=True, ge=1, le=200_000)] | None = None
    warm_requests: Annotated[int, Field(strict=True, ge=1, le=199_999)] | None = Field(
        None, description="the first this many requests (of the trace, or of the stored "
        "observations in completion order) are the past: every learner is told them all as "
        "finished before its replay, as a running service knows its history (its last "
        "requests would still be running there), and only the requests "
        "after them are replayed, by every policy (null, the default: learners start empty "
        "and the whole trace is replayed); must leave at least one request to replay")
    stage1: Stage1Rule = "auto"
    short_pool: ShortPoolRule = Field(
        BalanceRouteParams.short_pool,
        description="how BR-H's lookahead places a short pool under stage1 'auto': lpt-fit "
        "(default: largest first onto BR-0's worker if it fits there under the current "
        "maximum, else onto the best F), lpt (largest first onto the best F), lpt-load (as "
        "BR-0), best-pair (the best pair by F)")
    short_pool_growth: ShortPoolGrowth = Field(
        BalanceRouteParams.short_pool_growth,
        description="how short_pool's F projects the workers' growth with true lengths: "
        "requests (by the requests each holds now), slots (each free slot grows as an "
        "occupied one), filling (the default: slots while more arrivals than completions "
        "are expected within the window, requests otherwise) or arrivals (each free slot "
        "grows as the measured arrival rate is expected to fill it)")
    stage2_order: Stage2Order | None = Field(
        BalanceRouteParams.stage2_order,
        description="the order in which Stage 2 takes workers with free slots, BR-0 and BR-H: "
        "slots (most free slots first, then the widest margin; the paper's) or margin (the "
        "widest margin first); null (default): margin for BR-0, slots for BR-H")
    stage2_fill: bool | None = Field(
        BalanceRouteParams.stage2_fill,
        description="Stage 2 takes for each worker the most waiting requests that fit under "
        "the current maximum together, and the best F only where none fits (BF-IO's subset "
        "rule); false: the best F always (the paper's); null (default): the rule for BR-0, "
        "the paper's for BR-H")
    stage2_revisit: Annotated[bool, Field(strict=True)] = Field(
        BalanceRouteParams.stage2_revisit,
        description="a worker that took a Stage-2 subset with F > 0 and has slots left is "
        "taken again after every worker's first visit (a later admission may have raised the "
        "maximum), admitting only a subset with F > 0 then; false (default): each worker once")
    guard: GuardRule | None = Field(
        None,
        description="the starvation guard where a worker's best F in Stage 2 is not "
        "positive: always (admit the single best request anyway; the paper's) or idle "
        "(leave its slots empty this round where no request would lower the imbalance now); "
        "null (default): idle for BR-H, always for BR-0")
    patience: Annotated[int, Field(strict=True, ge=0, le=1_000_000_000)] | None = Field(
        BalanceRouteParams.patience,
        description="with the guard idle, a worker that has left its free slots empty this "
        "many rounds in a row takes its best request in the next (0: never waits; null, the "
        "default: no bound)")
    zero_gamma_rules: ZeroGammaRules = Field(
        BalanceRouteParams.zero_gamma_rules,
        description="a BR-H round whose discount is 0 (nothing the lookahead sees outlives "
        "it) is BR-0's round: br0 (default) with BR-0's guard and Stage 2 too, brh with "
        "BR-H's (the rule before 2026-12-05)")
    myopic_horizon: Annotated[float, Field(ge=1.0, le=1_000_000.0)] = Field(
        BalanceRouteParams.myopic_horizon,
        description="a BR-H round whose effective horizon 1/(1-gamma) is below this many "
        "steps is treated as a round at gamma 0 (1.5, the default: rounded to whole steps, "
        "one step; 1: only gamma 0, the rule before 2026-12-06)")
    own_wait_horizon: Annotated[float, Field(ge=1.0, le=1_000_000.0)] | None = Field(
        BalanceRouteParams.own_wait_horizon,
        description="with the guard idle, a BR-H round whose effective horizon 1/(1-gamma) "
        "reaches this many steps leaves a worker's slots empty wherever its own F of every "
        "subset is <= 0 (12, the default; null: never, the rule before 2026-12-06)")
    own_wait_learned: Annotated[bool, Field(strict=True)] = Field(
        BalanceRouteParams.own_wait_learned,
        description="the own wait (own_wait_horizon) also in rounds with a learned law (the "
        "rule from 2026-12-06 to 2026-12-07; false, the default: only in rounds without a "
        "learned law: true lengths, or c_hat alone)")
    learned_beta_scale: Annotated[float, Field(strict=True, gt=0.0, le=1_000_000.0)] = Field(
        BalanceRouteParams.learned_beta_scale,
        description="BR-H with a learned law: an overflow weight of this many times alpha * G "
        "(true lengths are never scaled)")
    marginal_overflow: Annotated[bool, Field(strict=True)] = Field(
        BalanceRouteParams.marginal_overflow,
        description="BR-H with a learned law: the overflow penalty is the rise of the expected "
        "overflow the admission causes (false, the default: the expected overflow itself)")
    learned_short_pool: Annotated[bool, Field(strict=True)] = Field(
        BalanceRouteParams.learned_short_pool,
        description="BR-H with a learned law places every short pool (every waiting request "
        "admitted this round) by its lookahead (false, the default: as BR-0 places it; true "
        "lengths are placed by the lookahead either way)")
    br0_check: Annotated[float, Field(ge=0.0, le=1_000_000.0)] | None = Field(
        BalanceRouteParams.br0_check,
        description="a BR-H round stands only where its own measure (summed F) is above "
        "that of BR-0's round from the same state by more than this many candidates' "
        "discounted fill, else the round is BR-0's (0: strictly better; null, the default: "
        "no check)")
    source: Literal["observations"] | None = Field(
        None, description="replay the service's own stored observations")
    trace: TraceIn | None = None

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

    @field_validator("warm_requests")
    @classmethod
    def _leaves_some(cls, value: int | None, info: ValidationInfo) -> int | None:
        requests = info.data.get("requests")
        if value is not None and requests is not None and value >= requests:
            raise ValueError(f"{value}: must be below requests ({requests}): some must be "
                             "left to replay")
        return value


class GridPoint(_Closed):
    horizon: Horizon
    beta: Annotated[float, Field(ge=0, le=1e6)] | None = Field(
        None, description="overflow weight; null: alpha * G (each step on BR-0's scale)")
    gamma: Annotated[float, Field(gt=0, le=1)] | Literal["turnover"] = Field(
        description="per-step discount, or 'turnover': from the fleet's turnover each round")
    learned_short_pool: Annotated[bool, Field(strict=True)] | None = Field(
        None, description="true: place a short pool by the learned law's lookahead; false: as "
        "BR-0 places it; null: the service's rule (BalanceRouteParams' default)")


def _grid_names_schema(schema: dict) -> None:
    """``grid``'s OpenAPI schema also admits the built-in grids' names (which the validator
    turns into their points)."""
    from .tuning import GRIDS

    schema["anyOf"] = [*schema.get("anyOf", []), {"type": "string", "enum": list(GRIDS)}]


class TuningIn(ReplayIn):
    """Replay recent stored traffic over BR-0 and a grid of BR-H settings."""

    source: Literal["observations"] = Field(
        "observations", description="the service's own stored observations (the most recent "
        "`requests` of them, in completion order)")
    workers: list[Workers] = Field(default_factory=lambda: [8], min_length=1, max_length=1)
    requests: Annotated[int, Field(strict=True, ge=1, le=200_000)] = 20_000
    estimator: str | Annotated[list[str], Field(min_length=1, max_length=16)] = Field(
        "exact_match", description="the estimator BR-H would use (left out: exact_match, or "
        "the service's auto estimator where it does not run exact_match), or a list of them: "
        "every BR-H setting is then replayed with each, and the recommendation names the "
        "learner of its pick; a name the service does not run is refused")
    grid: list[GridPoint] | None = Field(
        None, min_length=1, max_length=32, json_schema_extra=_grid_names_schema,
        validate_default=True,
        description="BR-H settings to try, or a built-in grid by name: 'turnover' (the "
        "default: the discount from the fleet's turnover) or 'wide' (with fixed discounts "
        "too), which stands for its points (a job's stored request lists them; null is the "
        "default); BR-0 always takes part")
    min_gain: Annotated[float, Field(ge=0, le=0.5)] = Field(
        MIN_GAIN, description="BR-H is recommended only if it beats BR-0's share of the balanced "
        "bound by this fraction, with no less throughput and no more imbalance, in every window")
    confirm: Annotated[bool, Field(strict=True)] = Field(
        False, description="rank the grid on the earlier of two windows of the replayed "
        "traffic and recommend its pick only if it wins again on the later window, which "
        "played no part in picking it (an option; default: rank and judge on both windows)")

    @field_validator("grid", mode="before")
    @classmethod
    def _named_grid(cls, value: object) -> object:
        """A built-in grid's name stands for its BR-H points; null for the default grid's."""
        from .tuning import DEFAULT_GRID, GRIDS, points_of

        if value is None:
            return points_of(DEFAULT_GRID)
        if isinstance(value, list):
            return value

        if not isinstance(value, str):
            raise ValueError(f"must be a list of points or a grid's name ({', '.join(GRIDS)})")
        if value not in GRIDS:
            raise ValueError(f"unknown grid {value!r}; known: {', '.join(GRIDS)}, or a list "
                             "of points")
        return points_of(GRIDS[value])

    @field_validator("estimator", mode="before")
    @classmethod
    def _registered(cls, value: object) -> object:
        """One clear error at ``body.estimator`` (not one per branch of the union)."""
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or not all(
                isinstance(n, str) for n in names):
            raise ValueError("must be an estimator's name or a non-empty list of names")
        learners_of(names)  # an unknown name: UnknownEstimatorError, a ValueError
        return value


class Recommendation(BaseModel):
    policy: Literal["br0", "brh"]
    horizon: int | None = None
    beta: float | None = None
    gamma: float | Literal["turnover"] | None = Field(
        None, description="per-step discount, or 'turnover': each round, the discount whose "
        "effective horizon is the steps between two admissions to one worker")
    estimator: str | None = None
    learned_short_pool: bool | None = Field(
        None, description="BR-H: a short pool placed by the lookahead with the learned law "
        "(absent in recommendations made before 2026-12-06: the router's own setting)")


class AbJobCreated(BaseModel):
    id: str = Field(description="poll GET /v1/ab-comparisons/{id}")


class AbJobOut(BaseModel):
    id: str
    status: Literal["queued", "running", "done", "failed", "cancelled"]
    progress: float = Field(description="0..1")
    results: list[dict] | dict = Field(
        description="A/B: rows with the schema of `balanceroute ab --json`; tuning: the ranked "
        "rows and the recommendation")
    error: str | None
    created_at: str
    request: dict = Field(description="the validated request (a trace's content left out)")
