"""The prediction service seen from the router: ``POST /v1/contributions`` over HTTP.

One persistent httpx connection, a short timeout (``timeout_s``, default 0.5 s: a refresh
that takes longer is worth less than BR-0 now). Any failure (timeout, connection refused, an
error status, an answer that does not fit) yields ``Prediction(None)``: the router falls back
to BR-0 and keeps routing. Finished requests go to an :class:`ObservationReporter`.

Request ids are sent as ``id_prefix + str(request_id)``, so that several replays against one
service do not collide on its idempotency key.
"""

from __future__ import annotations

import logging

import httpx
import numpy as np
import orjson

from .predictors import ActiveBatch, FinishedBatch, Prediction
from .reporter import ObservationReporter

log = logging.getLogger("balanceroute.router")


class HttpPredictor:
    def __init__(self, base_url: str, estimator: str = "auto", timeout_s: float = 0.5,
                 token: str | None = None, id_prefix: str = "",
                 flush_on_predict: bool = True) -> None:
        self.name = f"http:{estimator}"
        self.estimator = estimator
        self.id_prefix = id_prefix
        self.flush_on_predict = flush_on_predict
        self.client = httpx.Client(base_url=base_url, timeout=timeout_s)
        self.reporter = ObservationReporter(self.client, token=token)
        self.failures = 0
        self.last_error: str | None = None
        self.drifted = False

    def predict(self, batch: ActiveBatch, horizon: int) -> Prediction:
        if self.flush_on_predict:
            self.reporter.flush_due()
        items = [
            {"request_id": f"{self.id_prefix}{rid}", "prompt_key": key,
             "prompt_tokens": int(p), "generated_tokens": int(g)}
            for rid, key, p, g in zip(batch.request_ids.tolist(), batch.prompt_keys,
                                      batch.prompt_tokens, batch.generated_tokens, strict=True)
        ]
        try:
            response = self.client.post(
                "/v1/contributions",
                content=orjson.dumps({"horizon": horizon, "estimator": self.estimator,
                                      "items": items}),
                headers={"content-type": "application/json"},
            )
            response.raise_for_status()
            answer = orjson.loads(response.content)
            c_hat = np.fromiter((item["c_hat"] for item in answer["items"]), dtype=np.float64,
                                count=len(items))
            self.drifted = bool(answer.get("drifted", False))
        except (httpx.HTTPError, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.info("prediction refresh failed: %s", self.last_error)
            return Prediction(None)
        self.last_error = None
        return Prediction(c_hat, drifted=self.drifted)

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

    def close(self) -> None:
        self.reporter.stop(final_flush=True)
        self.client.close()
