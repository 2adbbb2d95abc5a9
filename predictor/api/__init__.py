"""The service's routes: one ``APIRouter`` module per resource.

    observations     POST /v1/observations
    contributions    POST /v1/contributions
    calibration      GET  /v1/calibration, /v1/calibration.png
    ab_comparisons   POST/GET /v1/ab-comparisons, GET/DELETE /v1/ab-comparisons/{id}
    tunings          POST/GET /v1/tunings, GET/DELETE /v1/tunings/{id}
    service          GET  /v1/status, /healthz, /readyz, /metrics

Handlers validate, call one service function and return a typed model; shared dependencies
(the service, the metrics, the write token) are ``Annotated`` aliases in :mod:`.deps`.
"""

from . import ab_comparisons, calibration, contributions, observations, service, tunings

ROUTERS = (observations.router, contributions.router, calibration.router,
           ab_comparisons.router, tunings.router, service.router)
