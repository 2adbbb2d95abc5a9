"""``POST /v1/contributions``: expected capped remaining life of active requests."""

from __future__ import annotations

from operator import itemgetter
from typing import cast

import numpy as np
import orjson
from fastapi import APIRouter, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.background import BackgroundTask

from ..estimators import UNKNOWN_TOKENS, Features
from ..metrics import Metrics
from ..schemas import (
    ContributionColumns,
    ContributionsIn,
    ContributionsOut,
    item_key,
    parse_contributions,
    prompt_key_of,
)
from ..service import PredictorService
from .deps import INVALID, TOO_LARGE, MetricsDep, ServiceDep, body_schema, invalid_body

router = APIRouter(prefix="/v1/contributions", tags=["prediction"])
_GENERATED = itemgetter("generated_tokens")


@router.post("", response_model=ContributionsOut, responses={**TOO_LARGE, **INVALID},
             openapi_extra=body_schema("ContributionsIn"))
async def post_contributions(request: Request, service: ServiceDep,
                             metrics: MetricsDep) -> Response:
    """Expected capped remaining life ``c_hat`` of each active request, in order.

    The requests come as ``items`` (a list of objects) or as ``columns`` (one array per
    field: half the bytes, several times cheaper to parse); the answer uses the same layout.
    The body is validated straight from its bytes (hot path: a router asks every few decode
    steps for hundreds of requests); errors are the usual 422 with locations.
    """
    try:
        body = parse_contributions(await request.body())
    except ValidationError as exc:
        raise invalid_body(exc) from None
    caller = request.client.host if request.client else ""
    return await run_in_threadpool(answer, body, service, metrics, caller)


def answer(body: ContributionsIn, service: PredictorService, metrics: Metrics,
           caller: str = "") -> Response:
    ids, features, columnar = _active_requests(body, service.settings.max_items_per_query)
    horizon = body.get("horizon") or service.settings.default_horizon
    name = body.get("estimator", "auto")
    if name != "auto" and name not in service.estimators:
        raise RequestValidationError([{
            "loc": ("body", "estimator"), "type": "not_enabled",
            "msg": f"estimator {name!r} is registered but not run by this service "
                   f"(BALANCEROUTE_ESTIMATORS); it runs {', '.join(service.estimators)}"}])
    result = service.contributions(features, horizon, name)
    estimate = result.estimate
    for name in set(estimate.source):
        metrics.items.labels(name).inc(estimate.source.count(name))
    metrics.hit_rate.set(service.hit_rate)
    mu = [None if m != m else m for m in estimate.mu_rem.tolist()]  # NaN -> null
    payload: dict[str, object] = {
        "horizon": horizon, "model_version": result.model_version, "drifted": result.drifted,
        "recommendation": service.recommendation,
    }
    fields = (ids, estimate.c_hat.tolist(), estimate.p_fin.tolist(), mu, estimate.source,
              estimate.support.tolist())
    if columnar:
        payload["columns"] = dict(zip(_ANSWER_FIELDS, fields, strict=True))
    else:  # dict displays: about 3x faster than dict(zip(_ANSWER_FIELDS, ...)) per item
        payload["items"] = [
            {"request_id": r, "c_hat": c, "p_fin": p, "mu_rem": m, "estimator": e, "support": n}
            for r, c, p, m, e, n in zip(*fields, strict=True)]
    # Calibration sampling runs after the answer is sent: off the router's latency path.
    record = BackgroundTask(service.record, ids, features, horizon, caller)
    return Response(orjson.dumps(payload), media_type="application/json", background=record)


_ANSWER_FIELDS = ("request_id", "c_hat", "p_fin", "mu_rem", "estimator", "support")


def _active_requests(body: ContributionsIn, limit: int) -> tuple[list[str], Features, bool]:
    """The request ids and features of the query's ``items`` or ``columns`` (exactly one),
    and whether it gave columns. 413 past ``limit`` requests; 422 naming the field when both
    or neither layout is given or a column's length differs from ``request_id``'s."""
    items, columns = body.get("items"), body.get("columns")
    if (items is None) == (columns is None):
        raise RequestValidationError([{
            "loc": ("body",), "type": "missing" if items is None else "value_error",
            "msg": "give the active requests as items or as columns (exactly one of them)"}])
    n = len(columns["request_id"]) if columns is not None else len(cast(list, items))
    if n > limit:
        raise HTTPException(413, f"{n} items; at most {limit} per query")
    if columns is not None:
        for field, values in cast(dict[str, list], columns).items():
            if len(values) != n:
                raise RequestValidationError([{
                    "loc": ("body", "columns", field), "type": "length_mismatch",
                    "msg": f"has {len(values)} entries; request_id has {n}: one entry per "
                           "request in every column"}])
        return columns["request_id"], _column_features(columns, n), True
    items = cast(list, items)  # given: not both absent, checked above
    keys = [i.get("prompt_key") for i in items]
    if None in keys:  # a prompt's text instead of its key: hashed
        keys = [item_key(i) for i in items]
    features = Features(
        np.fromiter(map(_GENERATED, items), np.int64, n), keys,
        np.fromiter([i.get("prompt_tokens", UNKNOWN_TOKENS) for i in items], np.int64, n),
    )
    return [i["request_id"] for i in items], features, False


def _column_features(columns: ContributionColumns, n: int) -> Features:
    keys: list[str | None] = columns.get("prompt_key") or [None] * n
    texts = columns.get("prompt")
    if texts is not None and None in keys:  # a prompt's text where no key is given: hashed
        keys = [prompt_key_of(key, text) for key, text in zip(keys, texts, strict=True)]
    tokens = columns.get("prompt_tokens")
    if tokens is None:
        prompt_tokens = np.full(n, UNKNOWN_TOKENS, np.int64)
    elif None in tokens:
        prompt_tokens = np.array([UNKNOWN_TOKENS if t is None else t for t in tokens], np.int64)
    else:
        prompt_tokens = np.array(tokens, np.int64)
    return Features(np.array(columns["generated_tokens"], np.int64).reshape(n), keys,
                    prompt_tokens.reshape(n))
