"""The one prediction path shared by the simulator and :class:`~router_client.client.RouterClient`.

:class:`PredictionCache` owns everything between a ``Predictor`` and a routing round:

- **Refresh** every ``refresh_steps`` steps (:meth:`due`; given the running requests' token
  counts, as RouterClient gives them, also once one of them has generated ``refresh_steps``
  tokens since the last refresh: a proxy's rounds are fewer than its decode steps; in the
  simulator a step is a decode step): one query for the active requests and the waiting
  ones (the latter at 0 tokens generated, so a request admitted between refreshes starts
  with its own prediction instead of the prior).
- **Health and fallback**: a refresh that fails (``c_hat is None``) or comes back
  ``drifted`` is unhealthy; the :class:`~router_client.fallback.FallbackController` decides
  whether BR-H may use predictions (BR-0 at once on an unhealthy refresh,
  ``healthy_to_return`` healthy ones to come back).
- **Warming up**: an answer flagged ``warming`` (no answer yet, the first query running)
  routes as BR-0 without consulting the controller and is asked again at the next step.
- **Aging** between refreshes (:func:`aged_c_hat`): an answer given ``e`` decode steps ago
  is ``max(c_hat - e, 1)`` now; an answer at the cap H stays at H. ``e`` is counted in the
  request's own tokens generated since it was asked about, when the caller passes the
  running requests' counts (the simulator and RouterClient do): a proxy's routing rounds are
  not decode steps (it routes when a slot frees, a few steps apart), so counting rounds would
  age answers too slowly. Without the counts, ``e`` is the rounds (``step``) since. A waiting
  request's life starts when it is admitted (:meth:`on_admit`), not when it was asked about.
  A law (``p_fin``, ``mu_rem``) ages by :func:`~router_client.projection.aged_law`: since
  2026-12-06 it is conditioned on the request still running (``end_shape="exponential"``);
  before, ``p_fin`` was kept and ``mu_rem`` moved ``e`` closer (``"uniform"``).
- **Unknown requests** (admitted without any prediction) count as ``c_hat = H``, the
  conservative prior, until the next refresh.

Request ids are opaque and hashable (the simulator's integers, a proxy's strings).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from .fallback import FallbackController
from .fleet import FleetView
from .predictors import ActiveBatch, Predictor, aged_c_hat, tokens_since
from .projection import END_SHAPE, aged_law


@dataclass(frozen=True)
class Refresh:
    """What one refresh did."""

    step: int
    healthy: bool
    reason: str  # ok | unavailable | drifted | warming
    use_predictions: bool


class PredictionCache:
    """Predictions of ``c_hat`` by request id, refreshed, aged and guarded by the fallback.

    Args:
        predictor: where predictions come from; ``None`` means BR-0 always.
        horizon: H.
        refresh_steps: steps between refreshes.
        controller: the fallback controller (a fresh one when not given).
    """

    def __init__(self, predictor: Predictor | None, horizon: int, refresh_steps: int = 10,
                 controller: FallbackController | None = None,
                 end_shape: str = END_SHAPE) -> None:
        if refresh_steps < 1:
            raise ValueError("refresh_steps must be >= 1")
        self.predictor = predictor
        self.horizon = horizon
        self.end_shape = end_shape  # how a law ages (router_client.projection.aged_law)
        self.refresh_steps = refresh_steps
        self.controller = controller or FallbackController()
        self.use_predictions = False
        self.recommendation: dict | None = None  # the predictor's advice, from the last answer
        self.last_refresh: int | None = None
        self.fallback_rounds = 0
        self._c_hat: dict[Hashable, float] = {}
        self._law: dict[Hashable, tuple[float, float]] = {}  # (p_fin, mu_rem), when given
        self._since: dict[Hashable, int] = {}  # step the answer's clock started (active ones)
        self._since_tokens: dict[Hashable, int] = {}  # tokens generated when it started
        self._asked_tokens: dict[Hashable, int] = {}  # running ones' tokens at the last refresh

    @property
    def enabled(self) -> bool:
        return self.predictor is not None and self.horizon > 0

    def due(self, step: int, running: Sequence[Hashable] | None = None,
            generated: Sequence[int] | np.ndarray | None = None) -> bool:
        """Whether to refresh at ``step``: ``refresh_steps`` rounds since the last refresh, or,
        given the running requests' token counts (same order as ``running``), as many decode
        steps, counted as the most tokens any of them generated since it was asked about."""
        if not self.enabled:
            return False
        if self.last_refresh is None or step - self.last_refresh >= self.refresh_steps:
            return True
        if running is None or generated is None or not self._asked_tokens:
            return False
        asked = self._asked_tokens
        steps = max((int(g) - asked[r] for r, g in zip(running, generated, strict=True)
                     if r in asked), default=0)
        return steps >= self.refresh_steps

    def refresh(self, step: int, batch: ActiveBatch, n_active: int) -> Refresh:
        """Ask about ``batch``: its first ``n_active`` requests are running (their answers'
        clocks start now), the rest are waiting (their clocks start at admission)."""
        if self.predictor is None:
            raise ValueError("no predictor to refresh from")
        prediction = self.predictor.predict(batch, self.horizon)
        if prediction.c_hat is None and prediction.warming:
            # not an answer yet, nor a failure: BR-0 until the first one, asked every step
            self.use_predictions = False
            self.controller.warming()
            return Refresh(step, False, "warming", False)
        self.last_refresh = step
        self._asked_tokens = dict(zip(
            batch.request_ids[:n_active].tolist(),
            np.asarray(batch.generated_tokens[:n_active]).tolist(), strict=True))
        if prediction.c_hat is None:
            healthy, reason = False, "unavailable"
        elif prediction.drifted:
            healthy, reason = False, "drifted"
        else:
            healthy, reason = True, "ok"
        if prediction.recommendation is not None:
            self.recommendation = prediction.recommendation
        if healthy and prediction.c_hat is not None:
            ids = batch.request_ids.tolist()
            values = np.asarray(prediction.c_hat, dtype=np.float64).tolist()
            self._c_hat = dict(zip(ids, values, strict=True))
            self._since = dict.fromkeys(ids[:n_active], step)
            self._since_tokens = dict(self._asked_tokens)
            self._law = {}
            if prediction.p_fin is not None and prediction.mu_rem is not None:
                self._law = dict(zip(ids, zip(np.asarray(prediction.p_fin).tolist(),
                                              np.asarray(prediction.mu_rem).tolist(),
                                              strict=True), strict=True))
        self.use_predictions = self.controller.on_refresh(step, healthy, reason)
        return Refresh(step, healthy, reason, self.use_predictions)

    def on_admit(self, request_id: Hashable, step: int) -> None:
        """A waiting request starts running: a prediction made while it waited ages from now."""
        if request_id in self._c_hat:
            self._since[request_id] = step
            self._since_tokens[request_id] = 0

    def forget(self, request_ids: Sequence[Hashable]) -> None:
        for request_id in request_ids:
            self._c_hat.pop(request_id, None)
            self._since.pop(request_id, None)
            self._since_tokens.pop(request_id, None)
            self._law.pop(request_id, None)

    def waiting_c_hat(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """The last answer for each waiting request (asked at 0 tokens generated), NaN where
        there is none; not aged, since a waiting request's life has not started."""
        return np.fromiter((self._c_hat.get(r, np.nan) for r in request_ids), np.float64,
                           len(request_ids))

    def annotate(self, view: FleetView, running: Sequence[Hashable],
                 waiting: Sequence[Hashable], step: int,
                 generated: Sequence[int] | np.ndarray | None = None) -> FleetView:
        """``view`` with everything BR-H reads from predictions: the aged ``c_hat`` of the
        ``running`` requests (in the view's order; and ``p_fin``, aged ``mu_rem`` when the
        predictor gave them) and the ``waiting`` ones' ``c_hat``. ``generated``: the running
        requests' tokens generated so far (same order), which age the answers (see the module
        docstring). While BR-H must route as BR-0 the view comes back without predictions
        (the round counts in ``fallback_rounds``). The simulator and RouterClient both route
        through this."""
        c_hat = self.c_hat_for(running, step, generated)
        if c_hat is None:
            return view
        p_fin = mu_rem = None
        if self._law:
            elapsed = self._elapsed(running, step, generated)
            unknown = (0.0, float(self.horizon))  # no answer: runs through the window
            laws = [self._law.get(r, unknown) for r in running]
            p_fin = np.fromiter((law[0] for law in laws), np.float64, len(laws))
            mu_rem = np.fromiter((law[1] for law in laws), np.float64, len(laws))
            p_fin, mu_rem = aged_law(p_fin, mu_rem, elapsed, self.horizon, self.end_shape)
        return replace(view, active_c_hat=c_hat, pool_c_hat=self.waiting_c_hat(waiting),
                       active_p_fin=p_fin, active_mu_rem=mu_rem)

    def c_hat_for(self, request_ids: Sequence[Hashable], step: int,
                  generated: Sequence[int] | np.ndarray | None = None) -> np.ndarray | None:
        """``c_hat`` now for running requests, or ``None`` while BR-H must route as BR-0
        (each such call is counted in ``fallback_rounds`` when predictions are wanted);
        ``generated`` as in :meth:`annotate`."""
        if not self.use_predictions:
            if self.horizon > 0:
                self.fallback_rounds += 1
            return None
        horizon = float(self.horizon)
        answered = np.fromiter((self._c_hat.get(r, horizon) for r in request_ids),
                               np.float64, len(request_ids))
        return aged_c_hat(answered, self._elapsed(request_ids, step, generated), self.horizon)

    def _elapsed(self, request_ids: Sequence[Hashable], step: int,
                 generated: Sequence[int] | np.ndarray | None) -> np.ndarray:
        """Decode steps since each answer's clock started: tokens generated since, when
        ``generated`` is given (0 for a request without an answer), else rounds since."""
        if generated is None:
            return step - self._since_of(request_ids, step)
        now = np.asarray(generated, dtype=np.int64)
        if now.shape != (len(request_ids),):
            raise ValueError("generated must give one count per running request")
        return tokens_since(now, np.fromiter((self._since_tokens.get(r, -1) for r in request_ids),
                                             np.int64, len(request_ids)))

    def _since_of(self, request_ids: Sequence[Hashable], step: int) -> np.ndarray:
        """The step each answer's clock started (now, for a request without one)."""
        return np.fromiter((self._since.get(r, step) for r in request_ids), np.int64,
                           len(request_ids))
