"""``GET /v1/calibration`` and its reliability diagram."""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from ..metrics import refresh_calibration_gauges
from ..schemas import CalibrationOut
from .deps import MetricsDep, ServiceDep

router = APIRouter(prefix="/v1", tags=["calibration"])

Horizon = Annotated[int | None, Query(ge=1, le=4096, description="only predictions at this H")]
Window = Annotated[int | None, Query(ge=1, description="only the most recent N scored")]
EstimatorFilter = Annotated[str | None, Query(
    description="one registered estimator (default: all, side by side)")]


def _checked(estimator: str | None, service) -> str | None:
    if estimator is not None and estimator not in service.estimators:
        raise RequestValidationError([{
            "loc": ("query", "estimator"), "type": "enum",
            "msg": f"unknown estimator; this service runs {', '.join(service.estimators)}"}])
    return estimator


@router.get("/calibration", response_model=CalibrationOut)
def calibration(service: ServiceDep, metrics: MetricsDep, horizon: Horizon = None,
                estimator: EstimatorFilter = None, window: Window = None) -> dict:
    """How good the issued predictions were: per estimator, scored on the same traffic."""
    report = service.calibration(horizon, _checked(estimator, service), window)
    refresh_calibration_gauges(report, metrics)
    return report


PNG_CACHE_SIZE = 16


@router.get("/calibration.png", responses={200: {"content": {"image/png": {}}}},
            response_class=Response)
def calibration_png(request: Request, service: ServiceDep, horizon: Horizon = None,
                    estimator: EstimatorFilter = None, window: Window = None) -> Response:
    """The reliability diagram of the same data. Drawing costs a good part of a CPU second,
    so a diagram is drawn once per (query, scored predictions so far) and then served from a
    small cache: repeated calls cost nothing until a new outcome is scored."""
    from ..plots import reliability_png  # matplotlib only when a diagram is asked for

    cache: OrderedDict = request.app.state.png_cache
    key = (horizon, _checked(estimator, service), window, service.tracker.scored.count)
    png = cache.get(key)
    if png is None:
        png = reliability_png(service.calibration(horizon, estimator, window))
        cache[key] = png
        while len(cache) > PNG_CACHE_SIZE:
            cache.popitem(last=False)
    return Response(png, media_type="image/png")
