"""Hazard: a feature-conditional, censoring-aware discrete-time hazard model (scikit-learn).

Output lengths are cut into log-spaced bins (``bins_per_octave`` per doubling: 0, 1, 2, 3, 4,
5, 6, 8, 10, 12, 16, ...). Each finished request becomes one row per bin it reached (the
person-period expansion): target 1 in the bin it ended in, 0 in the bins it survived. A
censored request (cut, cancelled, failed, or still running: see ``observe_running``)
contributes the bins it survived entirely and the one it is in, weighted by the share of that
bin's tokens it lived through (:func:`person_period`), so right-censoring is handled as
Kaplan-Meier handles it, and an unfinished length is never taken for an end. A
:class:`~sklearn.ensemble.HistGradientBoostingClassifier` (log loss) learns the bin hazard
``q_b(x) = P(end in bin b | reached b, x)`` from

- the bin (log of its first token),
- ``log1p(prompt_tokens)`` (-1 when unknown, below every known value: trees split it off),
- the prompt key's count of earlier observations (``log1p``) and its shrunk mean log output
  relative to the global mean ``g``, ``(sum - n * g) / (n + m0)`` over its earlier ended
  observations (``m0 = 1``; 0 for a new key, so the feature does not drift with ``g``), both
  as known *before* the observation (in finishing order), as they are at prediction,
- the bin's position relative to the key's shrunk mean (``log1p(e_b) - (g + deviation)``):
  where a key's lengths concentrate, the hazard is a diagonal function of bin and key mean,
  which trees on the two raw axes only approximate by staircases,

and their interactions (trees). Within a bin the per-token hazard is constant, so a request's
survival curve is piecewise geometric::

    S(t) = prod_{j < b} (1 - q_j) * (1 - q_b) ** ((t - e_b + 1) / w_b)   for e_b <= t < e_{b+1}

Bins past the longest one seen in training keep the last trained per-token hazard. ``c_hat``,
``p_fin`` and ``mu_rem`` follow from ``S(a)``, ``S(a+H)`` and ``sum_{h<H} S(a+h)`` (geometric
sums in closed form) conditioned on the tokens generated, as for Kaplan-Meier
(:func:`~predictor.estimators.km.residual_from_terms`).

Key curves (``key_curves``, default): a prompt key seen before also has its own Kaplan-Meier
curve (an :class:`~predictor.estimators.exact_match.ExactMatchEstimator` held inside), and the
answer is that curve shrunk toward the model's, ``(n * key + k * model) / (n + k)`` on the
curve terms, ``n`` the key's observations and ``k`` ExactMatch's empirical-Bayes weight: a
hierarchical model whose population level is the booster (conditional on the prompt and the
key's statistics) rather than one global curve. A key seen often answers with its own lengths,
a new key with the model's; before the first fit ExactMatch answers.

Online in mini-batches, deterministically: outcomes are buffered in a sliding window of the
most recent ``window`` observations and the model is refit from scratch when enough new ones
arrived: first at ``min_fit`` observations, then whenever the new ones reach the number seen at
the last fit, capped at ``refit_every`` (fits at 250, 500, 1000, 2000, then every 1000). The
booster has no early stopping and a fixed seed, so a replay (the simulator, a restarted service
rebuilding from its database batch by batch) fits the same models. Before the first fit the
window's Kaplan-Meier curve (:class:`~predictor.estimators.survival.SurvivalEstimator`)
answers. Each fit also takes the requests running at the latest query as censored rows
(:meth:`HazardEstimator.observe_running`), as Survival's curve does. A fit costs about a
second on 5000 observations; it runs in ``partial_fit``.

Prediction is cheap: curves are computed per distinct (quantized prompt length, key
statistics) group and cached until the next fit, so a refresh of 1,024 requests mostly reads
the cache (see the README for the measured cost).

Calibration: the booster minimizes log loss per bin, whose probabilities are close to
calibrated where it has data; ``p_fin`` is a product of them. Measured on the shadow replays
(``balanceroute calibrate``), see the README.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any, Self

import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier
from threadpoolctl import threadpool_limits

from .base import BaseEstimator, Estimate, Features, Outcomes
from .exact_match import ExactMatchEstimator
from .fit_worker import FitProcess, FitProcessError
from .km import residual_from_terms
from .survival import TAIL_AT_RISK, SurvivalEstimator

log = logging.getLogger(__name__)

MAX_TOKENS = 1 << 20
KEY_PRIOR = 1.0  # m0: pseudo-observations of the global mean in a key's shrunk mean
PROMPT_QUANTUM = 0.05  # log1p(prompt) quantum of the prediction groups (5% of length)
MEAN_QUANTUM = 0.02
MAX_CACHED_GROUPS = 65_536
UNKNOWN_PROMPT = -1.0  # log1p(prompt) of an unknown prompt length (real values are >= 0)


def bin_edges(per_octave: int, top: int = MAX_TOKENS) -> np.ndarray:
    """Log-spaced bin starts: 0, then ``floor(2 ** (i / per_octave))`` deduplicated."""
    steps = int(np.ceil(np.log2(top) * per_octave)) + 1
    starts = np.floor(2.0 ** (np.arange(steps) / per_octave)).astype(np.int64)
    return np.unique(np.concatenate([[0], starts[starts <= top]]))


def person_period(durations: np.ndarray, events: np.ndarray, edges: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows of the discrete-time expansion: (observation index, bin, ended in that bin, weight).

    An ended observation of length ``o`` reaches the bins up to the one holding ``o`` and ends
    in it (weight 1 each); a censored one (``o' > o``) survived the bins that end by ``o``
    (weight 1 each) and, where ``o`` falls inside a bin, that bin's first ``o - e_b + 1`` of
    its ``w_b`` tokens: one more row, target 0, weight ``(o - e_b + 1) / w_b`` (the actuarial
    exposure; dropping it, as this did until 2026-12-05, leaves the bin where requests are
    still running with their ends and none of their survival: a hazard near 1 there)."""
    holding = np.searchsorted(edges, durations, side="right") - 1
    survived_all = np.searchsorted(edges, durations + 1, side="right") - 1  # bins ending <= o
    partial = ~events & (survived_all == holding)
    count = np.where(events, holding + 1, survived_all + partial)
    owner = np.repeat(np.arange(durations.size), count)
    starts = np.cumsum(count) - count
    bins = np.arange(owner.size) - np.repeat(starts, count)
    target = events[owner] & (bins == holding[owner])
    weight = np.ones(owner.size)
    last = partial[owner] & (bins == holding[owner])
    widths = np.diff(edges).astype(np.float64)
    b = bins[last]
    weight[last] = (durations[owner[last]] - edges[b] + 1) / widths[b]
    return owner, bins, target, weight


class KeyStats:
    """Per-key count and sum of ended log lengths, bounded (least recently updated evicted)."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self.table: OrderedDict[str, list[float]] = OrderedDict()
        self.ended = 0
        self.total = 0.0

    @property
    def global_mean(self) -> float:
        return self.total / self.ended if self.ended else 0.0

    def features(self, keys: Iterable[str | None]) -> np.ndarray:
        """Rows of (log1p(count), shrunk mean log1p(output) less the global mean ``g``, and
        the shrunk mean itself) of the keys as of now (:func:`key_features` of :meth:`raw`):
        ``(sum - n * g) / (n + m0)`` is 0 for a key never seen (nothing known beyond ``g``)."""
        return key_features(np.array([self.raw(k) for k in keys]), self.global_mean)

    def learn(self, key: str | None, value: float, ended: bool) -> tuple[float, float, float]:
        """The key's statistics as of now (:meth:`raw`), then one more outcome of it counted,
        whose ``log1p(output)`` is ``value`` (one lookup of the key)."""
        if ended:
            self.ended += 1
            self.total += value
        if key is None:
            return 0.0, 0.0, 0.0
        table = self.table
        stats = table.get(key)
        seen = _raw(stats)
        if stats is None:
            stats = table[key] = [0.0, 0.0, 0.0]
            if len(table) > self.max_keys:
                table.popitem(last=False)
        else:
            table.move_to_end(key)
        stats[0] += 1
        if ended:
            stats[1] += 1
            stats[2] += value
        return seen

    def raw(self, key: str | None) -> tuple[float, float, float]:
        """(observations, ended observations, sum of their ``log1p(output)``) of a key as of
        now; zeros for a key never seen (or None)."""
        return _raw(self.table.get(key) if key is not None else None)


def key_features(raw: np.ndarray, g: float) -> np.ndarray:
    """:meth:`KeyStats.features` of rows of :meth:`KeyStats.raw` statistics, against the
    global mean ``g`` given: ``log1p(count)``, the shrunk deviation and the shrunk mean."""
    raw = np.asarray(raw, dtype=np.float64).reshape(-1, 3)
    deviation = (raw[:, 2] - raw[:, 1] * g) / (raw[:, 1] + KEY_PRIOR)
    return np.column_stack([np.log1p(raw[:, 0]), deviation, g + deviation])


def _raw(stats: list[float] | None) -> tuple[float, float, float]:
    return (stats[0], stats[1], stats[2]) if stats is not None else (0.0, 0.0, 0.0)


class Curves:
    """Piecewise-geometric survival curves of a set of groups (rows), one value per bin."""

    def __init__(self, hazard: np.ndarray, edges: np.ndarray, trained_bins: int) -> None:
        widths = np.diff(np.concatenate([edges, [2 * MAX_TOKENS]])).astype(np.float64)
        hazard = np.clip(hazard, 1e-9, 1 - 1e-9)
        log_rate = np.log1p(-hazard) / widths  # per-token log survival in each bin
        last = max(trained_bins - 1, 0)
        log_rate[:, last + 1:] = log_rate[:, last:last + 1]
        self.edges = edges
        self.widths = widths
        self.log_rate = log_rate
        per_bin = log_rate * widths
        self.log_start = np.concatenate(  # log S(e_b - 1): survival to the bin's start
            [np.zeros((hazard.shape[0], 1)), np.cumsum(per_bin, axis=1)[:, :-1]], axis=1)
        full = np.exp(self.log_start) * _geometric(log_rate, widths)  # each bin's whole area
        # sum_{u >= e_b} S(u), summed from the last bin down: a window's area is the
        # difference of two such tail sums, which keeps its precision against S(a) however
        # far out the window is (sums from 0 cancel there: an answer of c_hat 0 with p_fin
        # near 0 at a million generated tokens, before)
        after = np.cumsum(full[:, ::-1], axis=1)[:, ::-1]
        self.area_after = np.concatenate([after[:, 1:], np.zeros((hazard.shape[0], 1))], axis=1)

    def terms(self, group: np.ndarray, generated: np.ndarray, horizon: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``S(a)``, ``S(a+H)``, ``sum_{h<H} S(a+h)`` for items of the given groups."""
        return (self.survival(group, generated), self.survival(group, generated + horizon),
                self.tail(group, generated) - self.tail(group, generated + horizon))

    def _locate(self, group: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b = np.searchsorted(self.edges, t, side="right") - 1
        return b, (t - self.edges[b]).astype(np.float64)

    def survival(self, group: np.ndarray, t: np.ndarray) -> np.ndarray:
        b, into = self._locate(group, t)
        return np.exp(self.log_start[group, b] + (into + 1) * self.log_rate[group, b])

    def tail(self, group: np.ndarray, t: np.ndarray) -> np.ndarray:
        """``sum_{u >= t} S(u)``: the rest of t's bin, then the bins after it."""
        b, into = self._locate(group, t)
        rate = self.log_rate[group, b]
        rest = np.exp(self.log_start[group, b] + into * rate) * _geometric(
            rate, self.widths[b] - into)
        return rest + self.area_after[group, b]


def _geometric(log_rate: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``sum_{j=1}^{count} r ** j`` with ``r = exp(log_rate)`` (``count`` where r is 1)."""
    flat = log_rate > -1e-12
    safe = np.where(flat, -1.0, log_rate)
    value = np.exp(safe) * np.expm1(count * safe) / np.expm1(safe)
    return np.where(flat, count, value)


class HazardEstimator(BaseEstimator):
    """Discrete-time hazard model on prompt length and key statistics (see the module).

    Args:
        window: observations the model is fit on (the most recent).
        refit_every: at most this many new observations between fits.
        min_fit: observations before the first fit (Survival answers until then).
        bins_per_octave: length bins per doubling.
        max_keys: bound on the keys whose statistics are kept.
        max_iter, max_leaf_nodes, min_samples_leaf, learning_rate: the booster's.
        key_curves: shrink each known prompt key's own Kaplan-Meier curve toward the model's
            curve (:meth:`ExactMatchEstimator.shrink`, the same empirical-Bayes weight), so
            a key seen often answers with its own lengths and a new one with the model's.
        key_params: :class:`ExactMatchEstimator` arguments of those key curves (its window
            defaults to ``window``); its global curve is this model's fallback.
    """

    name = "hazard"

    def __init__(self, window: int = 5000, refit_every: int = 1000, min_fit: int = 250,
                 bins_per_octave: int = 3, max_keys: int = 100_000, max_iter: int = 100,
                 max_leaf_nodes: int = 15, min_samples_leaf: int = 40,
                 learning_rate: float = 0.1, key_curves: bool = True,
                 key_params: dict[str, Any] | None = None) -> None:
        if window < 1 or refit_every < 1 or min_fit < 1:
            raise ValueError("window, refit_every and min_fit must be >= 1")
        if bins_per_octave < 1:
            raise ValueError("bins_per_octave must be >= 1")
        self.window = window
        self.refit_every = refit_every
        self.min_fit = min_fit
        self.bins_per_octave = bins_per_octave
        self.max_keys = max_keys
        self.max_iter = max_iter
        self.max_leaf_nodes = max_leaf_nodes
        self.min_samples_leaf = min_samples_leaf
        self.learning_rate = learning_rate
        self.key_curves = key_curves
        self.key_params = key_params
        self.reset()

    def reset(self) -> Self:
        self.edges_ = bin_edges(self.bins_per_octave)
        self.keyed_: ExactMatchEstimator | None = None
        if self.key_curves:
            self.keyed_ = ExactMatchEstimator(**{"window": self.window,
                                                 **(self.key_params or {})})
            self.fallback_ = self.keyed_.fallback_  # one global curve for both
            self.keyed_.defer_fits = self._defer_fits
        else:
            self.fallback_ = SurvivalEstimator(
                self.window, (self.key_params or {}).get("tail_at_risk", TAIL_AT_RISK))
        self.keys_ = KeyStats(self.max_keys)
        # (log1p prompt or -1, the key's count, ended count and sum of log1p outputs before it
        # (KeyStats.raw), output, ended) per observation
        self.buffer_: deque[tuple[float, float, float, float, int, bool]] = deque(
            maxlen=self.window)
        self.model_: HistGradientBoostingClassifier | None = None
        self.trained_bins_ = 0
        self.n_fitted_ = 0
        self.n_fits_ = 0
        self._since_fit = 0
        self._skipped: tuple[np.ndarray, np.ndarray, np.ndarray, int] | None = None
        self._skipped_fits = 0
        self._cache: dict[int, int] = {}  # group code -> group id
        self._rows: dict[int, np.ndarray] = {}  # group code -> its features, for re-warming
        self._curves: list[Curves] = []
        self.running_: Features | None = None  # the latest running requests (observe_running)
        return self

    @property
    def n_observed_(self) -> int:
        return self.fallback_.n_observed_

    def observe_running(self, features: Features) -> Self:
        """The requests running now (``generated`` tokens so far), as right-censored evidence:
        for the fallback curve (see Survival) and for the model's next fit, where each counts
        the bins it has survived entirely at its current age, with its prompt and key
        statistics (as known at the fit). Fit on finished requests alone, the model sees the
        short ones first while the long ones still run (a young service, a burst) and learns
        hazards near 1 in the last bins it has seen, which every later bin inherits: on the
        Azure conversation trace at backlog, G = 16, it expected about 12 times the
        completions that came in the next step. The latest call's requests are kept (at most
        ``max_running``, the first ones, so no single query outweighs the window); a restart
        rebuilds from stored outcomes only, so its first model goes without them."""
        self._curves_learner.observe_running(features)
        alive = np.flatnonzero(features.generated > 0)[: self.max_running]
        self.running_ = features.take(alive) if alive.size else None
        return self

    @property
    def max_running(self) -> int:
        return max(1, self.window // 2)

    @property
    def _curves_learner(self) -> SurvivalEstimator | ExactMatchEstimator:
        """What learns the curves: the key curves (with the global one), or the global one."""
        return self.keyed_ if self.keyed_ is not None else self.fallback_

    def partial_fit(self, outcomes: Outcomes) -> Self:
        self._curves_learner.partial_fit(outcomes)
        prompts = _log_prompt(outcomes.prompt_tokens).tolist()
        ended = outcomes.events.tolist()
        outputs = outcomes.output_tokens.tolist()
        values = np.log1p(outcomes.output_tokens.astype(np.float64)).tolist()
        learn, append = self.keys_.learn, self.buffer_.append
        for i, key in enumerate(outcomes.prompt_key):
            count, key_ended, key_total = learn(key, values[i], ended[i])
            append((prompts[i], count, key_ended, key_total, outputs[i], ended[i]))
        self._since_fit += len(outcomes)
        if not self.defer_fits:
            fitted = self._fit_model(self._due_snapshot())
            if fitted is not None:
                self._install(fitted)
        return self

    def load_key_state(self, state) -> Self:
        """Set the per-key statistics :meth:`partial_fit` accumulates (least recently updated
        key first) and the global ended count and sum from a
        :class:`~predictor.snapshots.KeyState`: how a restart rebuilds them without replaying
        every observation."""
        table = self.keys_.table
        table.clear()
        for key, stats in state.key_statistics()[-self.max_keys:]:
            table[key] = stats
        self.keys_.ended, self.keys_.total = state.ended, state.total
        if self.keyed_ is not None:
            self.keyed_.load_key_state(state)
        return self

    # Replaying stored batches, the key curves' estimates of k are deferred as ExactMatch's
    # are (the service sets ``defer_refresh``, then calls :meth:`refresh_deferred`).
    @property
    def defer_refresh(self) -> bool:
        return self.keyed_ is not None and self.keyed_.defer_refresh

    @defer_refresh.setter
    def defer_refresh(self, value: bool) -> None:
        if self.keyed_ is not None:
            self.keyed_.defer_refresh = value

    def refresh_deferred(self) -> None:
        if self.keyed_ is not None:
            self.keyed_.refresh_deferred()

    # A service runs the booster's fits in a process of their own (``fit_process``): on a thread
    # they share the interpreter with the queries, whose P99 rose 2-4x while they ran. The fit
    # is the same function on the same snapshot either way (deterministic: one thread,
    # ``random_state=0``), so the models are identical; a failed process falls back to the
    # thread. Off by default (the simulator, the CLI's offline runs and the tests fit here).
    fit_in_subprocess = False

    # A service must not hold the lock its queries take during a fit (about a second): it
    # sets ``defer_fits`` and calls :meth:`fit_deferred` after each ingested batch, which fits
    # outside the lock on a snapshot taken under it. The schedule (which batch triggers a fit,
    # on which window) is the same, so a restarted service rebuilds the same models. The key
    # curves' estimates of k are deferred with it (see ``ExactMatchEstimator.fit_deferred``).
    _defer_fits = False

    @property
    def defer_fits(self) -> bool:
        return self._defer_fits

    @defer_fits.setter
    def defer_fits(self, value: bool) -> None:
        self._defer_fits = value
        if self.keyed_ is not None:
            self.keyed_.defer_fits = value

    def fit_deferred(self, lock) -> bool:
        """Fit if one is due: snapshot under ``lock``, fit outside it, install under it."""
        if self.keyed_ is not None:
            self.keyed_.fit_deferred(lock)
        with lock:
            snapshot = self._due_snapshot()
        fitted = self._fit_model(snapshot)
        if fitted is None:
            return False
        with lock:
            self._install(fitted)
        return True

    def skip_due_fit(self) -> None:
        """Replaying stored batches: take a due fit's window (as :meth:`fit_deferred` would)
        without fitting it. Every fit starts from scratch and is deterministic, so only the
        newest matters; :meth:`fit_skipped` fits it once the replay is done, and the model is
        the one the full schedule would have left (unless that fit had one class only)."""
        snapshot = self._due_snapshot()
        if snapshot is not None:
            self._skipped = snapshot
            self._skipped_fits += 1

    def fit_skipped(self) -> None:
        snapshot, skipped = self._skipped, self._skipped_fits
        self._skipped, self._skipped_fits = None, 0
        fitted = self._fit_model(snapshot)
        if fitted is not None:
            self._install(fitted)
            self.n_fits_ += skipped - 1  # counted as the full schedule would

    def _due_snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
        due = min(self.refit_every, max(self.min_fit, self.n_fitted_))
        if self._since_fit < due or len(self.buffer_) < self.min_fit:
            return None
        self._since_fit = 0
        rows = np.asarray([row[:4] for row in self.buffer_], dtype=np.float64)
        durations = np.fromiter((row[4] for row in self.buffer_), np.int64, len(self.buffer_))
        events = np.fromiter((row[5] for row in self.buffer_), bool, len(self.buffer_))
        prompts, raw = rows[:, 0], rows[:, 1:]
        running = self.running_
        if running is not None and len(running):
            prompts = np.concatenate([prompts, _log_prompt(running.prompt_tokens)])
            raw = np.concatenate([raw, np.array([self.keys_.raw(k)
                                                 for k in running.prompt_key])])
            durations = np.concatenate([durations, running.generated.astype(np.int64)])
            events = np.concatenate([events, np.zeros(len(running), dtype=bool)])
        # Each row's key statistics are as known before its end (a finished one) or now (a
        # running one), all measured against the global mean of this fit, as prediction
        # measures them: against each row's own global mean, a mean that drifts while the
        # service is young (short outputs end first) would tell rows of different times
        # apart, and the trees learned "the current mean runs on".
        data = np.column_stack([prompts, key_features(raw, self.keys_.global_mean)])
        return data, durations, events, len(self.buffer_)

    def _fit_model(self, snapshot) -> tuple[HistGradientBoostingClassifier, int, int] | None:
        if snapshot is None:
            return None
        params = {"max_iter": self.max_iter, "learning_rate": self.learning_rate,
                  "max_leaf_nodes": self.max_leaf_nodes,
                  "min_samples_leaf": self.min_samples_leaf}
        if self.fit_in_subprocess:
            try:
                return fit_process().call(snapshot, self.edges_, params)
            except FitProcessError as error:  # fit here rather than not at all
                log.warning("%s: fitting on this thread", error)
        return fit_booster(snapshot, self.edges_, params)

    def _install(self, fitted: tuple[HistGradientBoostingClassifier, int, int]) -> None:
        self.model_, self.trained_bins_, self.n_fitted_ = fitted
        self.n_fits_ += 1
        previous = self._rows
        self._cache, self._curves, self._rows = {}, [], {}
        self._rewarm(previous)

    def _design(self, bins: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return design_matrix(self.edges_, bins, rows)

    def predict(self, features: Features, horizon: int) -> Estimate:
        if self.model_ is None:
            return self._curves_learner.predict(features, horizon)
        n = len(features)
        group = self._groups(features)
        s_now, s_end, area = np.empty(n), np.empty(n), np.empty(n)
        chunk = group >> CHUNK_BITS
        for c in np.unique(chunk).tolist():
            rows = np.flatnonzero(chunk == c)
            s_now[rows], s_end[rows], area[rows] = self._curves[c].terms(
                group[rows] & (CHUNK - 1), features.generated[rows], horizon)
        if self.keyed_ is not None:
            (s_now, s_end, area), _ = self.keyed_.shrink(features, horizon,
                                                         (s_now, s_end, area))
        life = residual_from_terms(s_now, s_end, area, horizon)
        return Estimate(life.c_hat, life.p_fin, life.mu_rem, [self.name] * n,
                        np.full(n, self.n_fitted_, dtype=np.int64))

    def _group_features(self, features: Features) -> tuple[np.ndarray, np.ndarray]:
        """Each item's quantized (prompt, key count, key mean) and its integer code."""
        index: dict[str | None, int] = {}
        key_ids = np.fromiter((index.setdefault(k, len(index)) for k in features.prompt_key),
                              np.int64, len(features))
        stats = self.keys_.features(index)[key_ids]
        prompt = np.round(_log_prompt(features.prompt_tokens) / PROMPT_QUANTUM).astype(np.int64)
        prompt = np.clip(prompt, -20, 959)
        count = np.clip(np.round(stats[:, 0] * 100).astype(np.int64), 0, 4095)
        deviation = np.clip(np.round(stats[:, 1] / MEAN_QUANTUM).astype(np.int64), -2048, 2047)
        center = np.clip(np.round(stats[:, 2] / MEAN_QUANTUM).astype(np.int64), 0, 4095)
        code = ((prompt + 64) << 36) | (count << 24) | ((deviation + 2048) << 12) | center
        rows = np.column_stack([prompt * PROMPT_QUANTUM, count / 100, deviation * MEAN_QUANTUM,
                                center * MEAN_QUANTUM])
        return rows, code

    def _groups(self, features: Features) -> np.ndarray:
        """Each item's group id in the cache, computing curves for groups not yet cached."""
        rows, code = self._group_features(features)
        unique, first, inverse = np.unique(code, return_index=True, return_inverse=True)
        ids = np.empty(unique.size, dtype=np.int64)
        missing = []
        for j, value in enumerate(unique.tolist()):
            got = self._cache.get(value)
            if got is None:
                missing.append(j)
            else:
                ids[j] = got
        if missing:
            ids[missing] = self._add_groups(unique[missing], rows[first[missing]])
        return ids[inverse]

    def _add_groups(self, codes: np.ndarray, rows: np.ndarray) -> np.ndarray:
        if self.model_ is None:
            raise RuntimeError("no model to compute curves with")
        if len(self._cache) + codes.size > MAX_CACHED_GROUPS:
            self._cache, self._curves, self._rows = {}, [], {}
        trained = self.trained_bins_
        design = self._design(np.tile(np.arange(trained), codes.size),
                              np.repeat(rows, trained, axis=0))
        with threadpool_limits(1):
            hazard = self.model_.predict_proba(design)[:, 1].reshape(codes.size, trained)
        padded = np.pad(hazard, ((0, 0), (0, self.edges_.size - trained)), mode="edge")
        self._curves.append(Curves(padded, self.edges_, trained))
        ids = (len(self._curves) - 1) * CHUNK + np.arange(codes.size, dtype=np.int64)
        for code, gid, row in zip(codes.tolist(), ids.tolist(), rows, strict=True):
            self._cache[code] = gid
            self._rows[code] = row
        return ids

    def _rewarm(self, previous: dict[int, np.ndarray]) -> None:
        """After a fit, compute the curves of the most recent groups asked before it, so the
        first queries after a fit do not pay for them."""
        recent = list(previous.items())[-WARM_GROUPS:]
        if recent:
            self._add_groups(np.array([c for c, _ in recent], dtype=np.int64),
                             np.array([r for _, r in recent]))


CHUNK_BITS = 20
CHUNK = 1 << CHUNK_BITS  # group id = chunk index * CHUNK + row in that chunk's Curves
WARM_GROUPS = 2048


def _log_prompt(tokens: np.ndarray) -> np.ndarray:
    tokens = np.asarray(tokens, dtype=np.float64)
    return np.where(tokens >= 0, np.log1p(np.maximum(tokens, 0.0)), UNKNOWN_PROMPT)


def design_matrix(edges: np.ndarray, bins: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The booster's rows: log1p of each bin's start, the row's first three features and the
    bin's position against the row's fourth (its key's mean log length)."""
    position = np.log1p(edges[bins].astype(np.float64))
    return np.column_stack([position, rows[:, :3], position - rows[:, 3]])


def fit_booster(snapshot: tuple[np.ndarray, np.ndarray, np.ndarray, int], edges: np.ndarray,
                params: dict[str, Any]) -> tuple[HistGradientBoostingClassifier, int, int] | None:
    """Fit the discrete-time hazard booster on a snapshot (``HazardEstimator._due_snapshot``):
    the model, the bins it was trained on and the finished requests it saw; None with one
    class only (nothing a classifier can learn yet). A module-level function, so that a fit
    process can run it."""
    data, durations, events, outcomes = snapshot
    owner, bins, target, weight = person_period(np.minimum(durations, MAX_TOKENS), events,
                                                edges)
    if target.all() or not target.any():
        return None  # one class only: nothing a classifier can learn yet
    model = HistGradientBoostingClassifier(**params, early_stopping=False, random_state=0)
    with threadpool_limits(1):  # deterministic, and no oversubscription of shared cores
        model.fit(design_matrix(edges, bins, data[owner]), target, sample_weight=weight)
    return model, int(bins.max()) + 1, int(outcomes)  # the outcomes, not the running


_fit_process: FitProcess | None = None
_fit_process_lock = threading.Lock()


def fit_process() -> FitProcess:
    """The process that runs the hazard fits of every service in this interpreter
    (:mod:`predictor.estimators.fit_worker`), started at the first fit and kept."""
    global _fit_process
    with _fit_process_lock:
        if _fit_process is None:
            _fit_process = FitProcess()
        return _fit_process


def reset_fit_process() -> None:
    """Stop the fit process; the next fit starts another."""
    global _fit_process
    with _fit_process_lock:
        process, _fit_process = _fit_process, None
    if process is not None:
        process.close()


atexit.register(reset_fit_process)  # the worker stopped at exit, not left to the collector
