"""``POST /v1/contributions``: expected capped remaining life of active requests."""

from __future__ import annotations

from operator import itemgetter

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
from ..schemas import ContributionsIn, ContributionsOut, item_key, parse_contributions
from ..service import PredictorService
from .deps import MetricsDep, ServiceDep

router = APIRouter(prefix="/v1/contributions", tags=["prediction"])
_GENERATED = itemgetter("generated_tokens")


@router.post("", response_model=ContributionsOut,
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": {
                     "$ref": "#/components/schemas/ContributionsIn"}}}}})
async def post_contributions(request: Request, service: ServiceDep,
                             metrics: MetricsDep) -> Response:
    """Expected capped remaining life ``c_hat`` of each active request, in order.

    The body is validated straight from its bytes (hot path: a router asks every few decode
    steps for hundreds of requests); errors are the usual 422 with locations.
    """
    try:
        body = parse_contributions(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        ) from None
    caller = request.client.host if request.client else ""
    return await run_in_threadpool(answer, body, service, metrics, caller)


def answer(body: ContributionsIn, service: PredictorService, metrics: Metrics,
           caller: str = "") -> Response:
    items = body["items"]
    limit = service.settings.max_items_per_query
    if len(items) > limit:
        raise HTTPException(413, f"{len(items)} items; at most {limit} per query")
    horizon = body.get("horizon") or service.settings.default_horizon
    name = body.get("estimator", "auto")
    if name != "auto" and name not in service.estimators:
        raise RequestValidationError([{
            "loc": ("body", "estimator"), "type": "not_enabled",
            "msg": f"estimator {name!r} is registered but not run by this service "
                   f"(BALANCEROUTE_ESTIMATORS); it runs {', '.join(service.estimators)}"}])
    n = len(items)
    keys = [i.get("prompt_key") for i in items]
    if None in keys:  # a prompt's text instead of its key: hashed
        keys = [item_key(i) for i in items]
    features = Features(
        np.fromiter(map(_GENERATED, items), np.int64, n), keys,
        np.fromiter([i.get("prompt_tokens", UNKNOWN_TOKENS) for i in items], np.int64, n),
    )
    result = service.contributions(features, horizon, name)
    estimate = result.estimate
    for name in set(estimate.source):
        metrics.items.labels(name).inc(estimate.source.count(name))
    metrics.hit_rate.set(service.hit_rate)
    mu = [None if m != m else m for m in estimate.mu_rem.tolist()]  # NaN -> null
    ids = [i["request_id"] for i in items]
    payload = {
        "horizon": horizon, "model_version": result.model_version, "drifted": result.drifted,
        "recommendation": service.recommendation,
        "items": [
            {"request_id": r, "c_hat": c, "p_fin": p, "mu_rem": m, "estimator": e, "support": s}
            for r, c, p, m, e, s in zip(ids, estimate.c_hat.tolist(), estimate.p_fin.tolist(),
                                        mu, estimate.source, estimate.support.tolist(),
                                        strict=True)
        ],
    }
    # Calibration sampling runs after the answer is sent: off the router's latency path.
    record = BackgroundTask(service.record, ids, features, horizon, caller)
    return Response(orjson.dumps(payload), media_type="application/json", background=record)
