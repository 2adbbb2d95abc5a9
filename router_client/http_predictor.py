"""The prediction service seen from the router: ``POST /v1/contributions`` over HTTP.

One persistent httpx connection, a short timeout (``timeout_s``, default 0.5 s: a refresh
that takes longer is worth less than BR-0 now). Any failure (timeout, connection refused, an
error status, an answer that does not fit) yields ``Prediction(None)``: the router falls back
to BR-0 and keeps routing.

Finished requests go to an :class:`ObservationReporter` with its own connection, in one of
two modes (``report``):

- ``"background"`` (default, for a serving proxy): the reporter's thread, started at the first
  finished request, posts them; ``predict`` and ``observe`` never wait on the network for it.
- ``"sync"`` (for replays): ``predict`` first flushes what is due, on the caller's thread, so
  that what the service has learned at each refresh, and so the run, is reproducible.
  ``balanceroute ab --predictor-url`` uses it.

``config_error`` is set when the service refuses the reports as misconfigured (401, 403, 404);
:meth:`close` makes the final flush and returns what was delivered and dropped.

Request ids are sent as ``id_prefix + str(request_id)``, so that several replays against one
service do not collide on its idempotency key.
"""

from __future__ import annotations

import logging
from typing import Literal

import httpx
import numpy as np
import orjson

from .predictors import ActiveBatch, FinishedBatch, Prediction
from .reporter import ObservationReporter

log = logging.getLogger("balanceroute.router")


class HttpPredictor:
    def __init__(self, base_url: str, estimator: str = "auto", timeout_s: float = 0.5,
                 token: str | None = None, id_prefix: str = "",
                 report: Literal["background", "sync"] = "background",
                 flush_on_predict: bool | None = None, report_interval_s: float = 0.5,
                 report_timeout_s: float | None = None,
                 follow_recommendation: bool = True) -> None:
        """``flush_on_predict`` is the older spelling of the mode: True is ``"sync"``, False
        ``"background"``. ``report_timeout_s`` bounds one report post (default: ``timeout_s``
        in sync mode, where it is on the caller's path, else 5 s)."""
        if flush_on_predict is not None:
            report = "sync" if flush_on_predict else "background"
        if report not in ("background", "sync"):
            raise ValueError("report must be 'background' or 'sync'")
        self.name = f"http:{estimator}"
        self.estimator = estimator
        self.follow_recommendation = follow_recommendation
        self.id_prefix = id_prefix
        self.report = report
        self.report_interval_s = report_interval_s
        self.client = httpx.Client(base_url=base_url, timeout=timeout_s)
        if report_timeout_s is None:
            report_timeout_s = timeout_s if report == "sync" else max(timeout_s, 5.0)
        self.report_client = httpx.Client(base_url=base_url, timeout=report_timeout_s)
        self.reporter = ObservationReporter(self.report_client, token=token)
        self.failures = 0
        self.last_error: str | None = None
        self.drifted = False
        self.closed = False
        self.columnar = True  # False once a service has refused the columnar layout
        self.asked = 0  # queries made; columns are tried again every COLUMNS_RETRY_EVERY

    @property
    def flush_on_predict(self) -> bool:
        return self.report == "sync"

    @property
    def config_error(self) -> str | None:
        """Set when the service refused the reports as misconfigured (401, 403, 404)."""
        return self.reporter.config_error

    def predict(self, batch: ActiveBatch, horizon: int) -> Prediction:
        if self.report == "sync":
            self.reporter.flush_due()
        n = len(batch.request_ids)
        try:
            answer = self._ask(batch, horizon)
            c_hat, p_fin, mu_rem = (_column(answer, f, n) for f in ("c_hat", "p_fin", "mu_rem"))
            if not np.isfinite(c_hat).all():
                raise ValueError("c_hat is not a number for every request")
            self.drifted = bool(answer.get("drifted", False))
            recommendation = answer.get("recommendation")
            if recommendation is not None and not isinstance(recommendation, dict):
                raise TypeError("recommendation is not an object")
        except (httpx.HTTPError, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.info("prediction refresh failed: %s", self.last_error)
            return Prediction(None)
        self.last_error = None
        if recommendation is not None and self.follow_recommendation and recommendation.get(
                "policy") == "brh" and isinstance(recommendation.get("estimator"), str):
            self.estimator = recommendation["estimator"]  # ask that one from the next refresh
        known = np.isfinite(p_fin).all()
        return Prediction(c_hat, drifted=self.drifted, recommendation=recommendation,
                          p_fin=p_fin if known else None, mu_rem=mu_rem if known else None)

    def _ask(self, batch: ActiveBatch, horizon: int) -> dict:
        """Post the query; the answer's ``c_hat``, ``p_fin``, ``mu_rem`` as lists (by field),
        with ``drifted`` and ``recommendation``. Columns first (half the bytes of items, and
        cheaper to parse on both sides); a service that refuses them (422: one older than the
        columnar layout) is asked with items from then on, and with columns again every
        ``COLUMNS_RETRY_EVERY`` queries (it may have been upgraded). The answer must name the
        query's requests in order."""
        ids = [f"{self.id_prefix}{rid}" for rid in batch.request_ids.tolist()]
        self.asked += 1
        if not self.columnar and self.asked % COLUMNS_RETRY_EVERY == 0:
            self.columnar = True  # the service may have been upgraded (a rolling upgrade)
        columns = {"request_id": ids, "prompt_key": list(batch.prompt_keys),
                   "prompt_tokens": np.asarray(batch.prompt_tokens, np.int64).tolist(),
                   "generated_tokens": np.asarray(batch.generated_tokens, np.int64).tolist()}
        body: dict = {"horizon": horizon, "estimator": self.estimator}
        if self.columnar:
            response = self._post({**body, "columns": columns})
            if not _refuses_columns(response):
                response.raise_for_status()
                answer = orjson.loads(response.content)
                columns_out = answer["columns"]
                if not isinstance(columns_out, dict) or columns_out.get("request_id") != ids:
                    raise ValueError("the answer's request_id column is not the query's")
                return {**columns_out, "drifted": answer.get("drifted", False),
                        "recommendation": answer.get("recommendation")}
            self.columnar = False
            log.info("the prediction service refused columns; asking with items from now on")
        response = self._post({**body, "items": [dict(zip(columns, item, strict=True))
                                                 for item in zip(*columns.values(), strict=True)]})
        response.raise_for_status()
        answer = orjson.loads(response.content)
        items = answer["items"]
        if not isinstance(items, list) or [i["request_id"] for i in items] != ids:
            raise ValueError("the answer's items are not the query's requests, in order")
        return {"c_hat": [i["c_hat"] for i in items], "p_fin": [i.get("p_fin") for i in items],
                "mu_rem": [i.get("mu_rem") for i in items], "drifted": answer.get("drifted", False),
                "recommendation": answer.get("recommendation")}

    def _post(self, body: dict) -> httpx.Response:
        return self.client.post("/v1/contributions", content=orjson.dumps(body),
                                headers={"content-type": "application/json"})

    def observe(self, finished: FinishedBatch) -> None:
        reasons = finished.finish_reasons or [
            "length" if c else "stop" for c in finished.censored.tolist()]
        self.reporter.add([
            {"request_id": f"{self.id_prefix}{rid}", "prompt_key": key,
             "prompt_tokens": int(p), "output_tokens": int(o), "finish_reason": reason}
            for rid, key, p, o, reason in zip(finished.request_ids.tolist(),
                                              finished.prompt_keys, finished.prompt_tokens,
                                              finished.output_tokens, reasons, strict=True)
        ])
        if self.report == "background" and not self.closed and not self.reporter.running:
            self.reporter.start(self.report_interval_s)

    def close(self) -> dict:
        """Final flush of the outcomes still buffered; returns the reporter's counters."""
        if self.closed:
            return self.reporter.stats()
        self.closed = True
        stats = self.reporter.stop(final_flush=True)
        self.client.close()
        self.report_client.close()
        return stats


COLUMNS_RETRY_EVERY = 100  # queries in items between two tries of columns


def _column(answer: dict, field: str, n: int) -> np.ndarray:
    """One answer field for the n requests, as floats (null: NaN); anything but a flat list
    of n numbers or nulls is an error."""
    values = answer[field]
    if not isinstance(values, list) or len(values) != n:
        raise ValueError(f"{field} is not a list of {n} values")
    out = np.array(values, dtype=np.float64)
    if out.ndim != 1:
        raise ValueError(f"{field} is not a flat list")
    return out


def _refuses_columns(response: httpx.Response) -> bool:
    """A 422 from a service older than the columnar layout: ``columns`` an extra field,
    ``items`` missing. Any other 422 (a bad estimator, say) is an error like the rest."""
    if response.status_code != 422:
        return False
    try:
        errors = {(tuple(e["loc"]), e["type"]) for e in orjson.loads(response.content)["detail"]}
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False
    return ((("body", "columns"), "extra_forbidden") in errors
            or (("body", "items"), "missing") in errors)
