"""Projected per-worker loads over the next H steps (BR-H's lookahead and the c_hat predictor).

An active request with current work ``w = s + a`` reads ``w + h`` KV tokens h steps ahead if
it is still running. With ``c_hat`` its expected capped remaining life, it is taken to run at
step h with weight ``clip(c_hat - h, 0, 1)``: fully for the first ``floor(c_hat)`` steps, a
fraction on the next, not after. Since an active request always runs its next step,
``c_hat >= 1`` and the h = 0 column equals the current loads. ``c_hat = H`` means "at least
H": such a request runs at every step of the window, h = H included.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

END_POINTS = 4  # points of the spread end-time law (mixture_loads); 0: the point law
EndShape = Literal["exponential", "uniform"]
END_SHAPE: EndShape = "exponential"  # the end-time law (end_rate); "uniform" before


def mixture_loads(
    workers: int,
    horizon: int,
    active_worker: np.ndarray,
    active_size: np.ndarray,
    p_fin: np.ndarray,
    mu_rem: np.ndarray,
    refill: float | None = None,
    end_points: int = END_POINTS,
    end_shape: str = END_SHAPE,
) -> np.ndarray:
    """Expected loads when each request ends within H with probability ``p_fin``, after
    ``mu_rem`` steps on average if it does, and runs through the window otherwise.

    The law the service's (``c_hat``, ``p_fin``, ``mu_rem``) describe: weight ``1 - p_fin``
    of the request alive throughout, weight ``p_fin`` of it ending at a time T within the
    window with mean ``mu_rem``. A deterministic step at ``c_hat = (1 - p_fin) H + p_fin
    mu_rem`` would take a request that is as likely to end in 5 steps as to outlive the
    window for one that surely runs 42 steps and then surely stops.

    T inside the window follows ``end_shape``: ``"exponential"`` (the default since
    2026-12-06), the law of a constant hazard truncated to the window with mean ``mu``
    (:func:`end_rate`: front-loaded for a short ``mu``, uniform at ``mu = H/2``, loaded towards
    H above it); ``"uniform"`` (before), uniform on ``[0, 2 mu]`` when ``mu <= H/2``, on
    ``[2 mu - H, H]`` otherwise. Either is taken at ``end_points`` quantile midpoints of
    weight ``p_fin / end_points``. A point at t (clipped to [1, H]) runs fully
    before ``floor(t)`` and with weight ``t - floor(t)`` at ``floor(t)``, as
    :func:`projected_loads` takes a ``c_hat`` below H; at H = 1 every point is 1 and the
    request's ending share has ended at step 1 (where ``projected_loads`` would read a
    ``c_hat`` of H as "at least H"). ``end_points=0`` puts all of it at ``mu`` (the point
    law; it treats the mean end time as known, and a router that looks a few steps ahead
    then sees no ending at all before ``mu``). The oracle does not come here: true lengths
    are a deterministic ``c_hat`` (:func:`projected_loads`).
    """
    return mixture_moments(workers, horizon, active_worker, active_size, p_fin, mu_rem,
                           refill=refill, end_points=end_points, end_shape=end_shape)[0]


def mixture_moments(
    workers: int,
    horizon: int,
    active_worker: np.ndarray,
    active_size: np.ndarray,
    p_fin: np.ndarray,
    mu_rem: np.ndarray,
    refill: float | None = None,
    end_points: int = END_POINTS,
    spread: bool = False,
    end_shape: str = END_SHAPE,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The mean (:func:`mixture_loads`) and, with ``spread``, the standard deviation of each
    worker's load h steps ahead, shapes ``(G, H+1)``.

    The spread takes each request to run at step h with probability ``q_h`` (the weight
    :func:`mixture_loads` gives it there), independently of the others, reading ``w + h``
    tokens if it does: its load has variance ``(w + h)^2 q_h (1 - q_h)``, a worker's is the
    sum over its requests, and the h = 0 column is 0 (an active request runs its next step).

    A request runs at step h with probability ``q_h = 1 - p_fin + p_fin * a_h``, ``a_h`` the
    share of its end points still running at h. ``q`` is piecewise constant in h: it changes
    only at ``floor(t)`` and ``floor(t) + 1`` of each point t. So each request adds its
    changes of ``q`` (and of ``q (1 - q)``) at those few steps to per-worker difference
    arrays, weighted by the powers of its work ``w`` that ``(w + h) q`` and ``(w + h)^2
    q (1 - q)`` need, and prefix sums give the moments at every step: ``O(n * points +
    G * H)``, not ``O(n * H)``.
    """
    shape = (workers, horizon + 1)
    size = np.asarray(active_size, dtype=np.float64)
    owner = np.asarray(active_worker, dtype=np.int64)
    if owner.size == 0 or horizon == 0:
        loads = np.zeros(shape)
        loads[:, 0] = np.bincount(owner, weights=size, minlength=workers)
        return loads, (np.zeros(shape) if spread else None)
    p, mu = end_law(p_fin, mu_rem, horizon)
    points = np.clip(mu[:, None] if end_points <= 0
                     else _end_times(mu, horizon, end_points, end_shape),
                     1.0, float(horizon))  # (n, K), ascending along K
    whole = np.floor(points).astype(np.int64)
    frac = points - whole
    # Each point's running share drops by (1 - frac) / K at floor(t), by frac / K a step
    # later. In step order, after a start at h = 0 (q = 1): q after each change; where a step
    # has several, only the last value holds there and the differences sum to it.
    n, k = points.shape
    steps = np.empty((n, 2 * k + 1), dtype=np.int64)
    steps[:, 0], steps[:, 1:k + 1], steps[:, k + 1:] = 0, whole, whole + 1
    drops = np.empty((n, 2 * k + 1))
    drops[:, 0], drops[:, 1:k + 1], drops[:, k + 1:] = 0.0, (1.0 - frac) / k, frac / k
    order = (np.argsort(steps, axis=1, kind="stable")
             + np.arange(0, steps.size, 2 * k + 1)[:, None]).ravel()
    steps = steps.ravel()[order].reshape(n, 2 * k + 1)
    q = (1.0 - p)[:, None] + p[:, None] * (
        1.0 - np.cumsum(drops.ravel()[order].reshape(n, 2 * k + 1), axis=1))
    dq = _changes(q)
    weights = [dq * size[:, None], dq]  # E load = sum q w + h sum q
    if spread:  # Var load = sum q (1 - q) (w^2 + 2 h w + h^2)
        dv = _changes(q * (1.0 - q))
        # and how many requests are uncertain (0 < q < 1), counted exactly: where none is,
        # the variance is exactly 0, not the rounding the prefix sums of w^2 leave behind
        uncertain = _changes(((q > 0.0) & (q < 1.0)).astype(np.float64))
        weights += [dv * (size * size)[:, None], dv * size[:, None], dv, uncertain]
    width = horizon + 2
    where = ((owner * width)[:, None] + steps).ravel()
    sums = [np.cumsum(np.bincount(where, weights=weight.ravel(), minlength=workers * width)
                      .reshape(workers, width), axis=1)[:, :-1] for weight in weights]
    h = np.arange(horizon + 1, dtype=np.float64)[None, :]
    loads = sums[0] + h * sums[1]
    if refill is not None:
        loads += _mixture_refills(workers, horizon, owner, p, whole, frac, refill)
    if not spread:
        return loads, None
    variance = sums[2] + 2.0 * h * sums[3] + h * h * sums[4]
    variance[sums[5] < 0.5] = 0.0
    return loads, np.sqrt(np.maximum(variance, 0.0))


def _changes(values: np.ndarray) -> np.ndarray:
    """Differences along the last axis (the first against 0)."""
    out = values.copy()
    out[:, 1:] -= values[:, :-1]
    return out


def _mixture_refills(workers: int, horizon: int, owner: np.ndarray, p: np.ndarray,
                     whole: np.ndarray, frac: np.ndarray, refill: float) -> np.ndarray:
    """The refills of the slots each end point empties (see :func:`projected_loads`): one of
    ``refill`` tokens from step ``floor(t)``, growing, sharing that step with the part of the
    request still running there."""
    width = horizon + 2
    weight = np.repeat(p / whole.shape[1], whole.shape[1])
    where = (owner * width)[:, None] + whole
    out = _refills(workers, horizon, where.ravel(), weight, whole.ravel(), refill)
    out -= np.bincount(where.ravel(), weights=frac.ravel() * weight * refill,
                       minlength=workers * width).reshape(workers, width)[:, :-1]
    return out


def end_law(p_fin: np.ndarray, mu_rem: np.ndarray, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """``p_fin`` clipped to [0, 1]; ``mu_rem`` below H, and H where unknown or ``p_fin`` is 0."""
    p = np.clip(np.asarray(p_fin, dtype=np.float64), 0.0, 1.0)
    mu = np.asarray(mu_rem, dtype=np.float64)
    mu = np.minimum(np.where(np.isfinite(mu) & (p > 0), mu, float(horizon)), horizon - 1e-9)
    return p, mu


def end_window(mu: np.ndarray, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """Where the uniform end-time law with mean ``mu`` lies (see :func:`mixture_loads`):
    ``[0, 2 mu]`` when ``mu <= H/2``, ``[2 mu - H, H]`` otherwise; (low, high)."""
    low = np.where(mu <= horizon / 2, 0.0, 2.0 * mu - horizon)
    high = np.where(mu <= horizon / 2, 2.0 * mu, float(horizon))
    return low, high


_EPS = 1e-6


def mean_fraction(x: np.ndarray) -> np.ndarray:
    """The mean of the end-time law with rate ``x / H`` on ``[0, H]``, as a fraction of H:
    ``1/x - 1/(e^x - 1)`` (1/2 at x = 0, the uniform law; towards 0 as x grows, towards 1 as
    it falls below 0)."""
    x = np.asarray(x, dtype=np.float64)
    small = np.abs(x) < 1e-4
    safe = np.where(small, 1.0, x)
    with np.errstate(over="ignore"):
        out = 1.0 / safe - 1.0 / np.expm1(safe)
    return np.where(small, 0.5 - x / 12.0, out)


_RATE_GRID = np.sinh(np.linspace(-np.arcsinh(400.0), np.arcsinh(400.0), 2049))
_MEAN_GRID = mean_fraction(_RATE_GRID)[::-1]  # ascending, for np.interp
_RATE_BY_MEAN = _RATE_GRID[::-1]


def end_rate(mu: np.ndarray, horizon: int) -> np.ndarray:
    """The rate ``x`` (per window, ``x / H`` per step) of the truncated exponential law on
    ``[0, H]`` whose mean is ``mu``: the end time of a request with a constant hazard, given
    that it ends within the window (x > 0: front-loaded, a short ``mu``; x = 0: uniform, ``mu
    = H/2``; x < 0: loaded towards H). Beyond the grid's ends, the asymptotes ``x = 1 / m``
    and ``x = -1 / (1 - m)`` (m = mu / H)."""
    m = np.clip(np.asarray(mu, dtype=np.float64) / horizon, 1e-9, 1.0 - 1e-9)
    x = np.interp(m, _MEAN_GRID, _RATE_BY_MEAN)
    for _ in range(2):  # Newton steps from the table's interpolation (to ~1e-12)
        x = x - (mean_fraction(x) - m) / _mean_slope(x)
    x = np.where(m < _MEAN_GRID[0], 1.0 / m, x)
    return np.where(m > _MEAN_GRID[-1], -1.0 / (1.0 - m), x)


def _mean_slope(x: np.ndarray) -> np.ndarray:
    """The derivative of :func:`mean_fraction`: ``e^x / (e^x - 1)^2 - 1 / x^2`` (-1/12 at
    0), always below 0."""
    small = np.abs(x) < 1e-3
    safe = np.where(small, 1.0, np.clip(x, -600.0, 600.0))
    return np.where(small, -1.0 / 12.0 + x * x / 240.0,
                    0.25 / np.sinh(safe / 2.0) ** 2 - 1.0 / safe**2)


def end_cdf(s: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``P(T <= s H)`` under the law of :func:`end_rate` with rate ``x``, for ``s`` in [0, 1]
    (broadcasting)."""
    s = np.clip(np.asarray(s, dtype=np.float64), 0.0, 1.0)
    x = np.asarray(x, dtype=np.float64)
    pos = np.where(x > _EPS, x, 1.0)
    neg = np.where(x < -_EPS, -x, 1.0)
    with np.errstate(over="ignore", under="ignore"):
        rising = np.expm1(-pos * s) / np.expm1(-pos)
        falling = np.exp(neg * (s - 1.0)) * np.expm1(-neg * s) / np.expm1(-neg)
    return np.where(x > _EPS, rising, np.where(x < -_EPS, falling, s))


def expected_ends(p: np.ndarray, mu: np.ndarray, horizon: int) -> np.ndarray:
    """``sum_i p_i P(T_i <= t)`` for t = 1..H under the law of :func:`end_rate` (what
    :func:`end_cdf` gives, summed). With ``q = e^{-|x| / H}``, ``P(T <= t) = (1 - q^t) / (1 -
    q^H)`` for x > 0; a law with x < 0 is the mirror image of the one with rate ``|x|``,
    ``P(T <= t) = 1 - P(T' <= H - t)``. The powers of q come from a running product, and each
    side is one weighted sum over requests (``O(n H)`` multiplications, no exponential per
    step)."""
    t = np.arange(1, horizon + 1, dtype=np.float64)
    x = end_rate(mu, horizon)
    flat = np.abs(x) <= _EPS
    out = float(p[flat].sum()) * t / horizon
    if flat.all():
        return out
    q = np.where(flat, 0.0, np.exp(-np.abs(x) / horizon))
    powers = np.cumprod(np.broadcast_to(q[:, None], (q.size, horizon)), axis=1)  # q^1..q^H
    weight = np.where(flat, 0.0, p / np.where(flat, 1.0, 1.0 - powers[:, -1]))
    rising = np.where(x > 0, weight, 0.0)
    falling = np.where(x < 0, weight, 0.0)
    # sum_i w_i (1 - q_i^j): the rising side at j = t; the falling side's mirror at j = H - t,
    # for j = 0..H (0 at j = 0)
    out += rising.sum() - rising @ powers
    mirror = np.empty(horizon + 1)
    mirror[0], mirror[1:] = 0.0, falling.sum() - falling @ powers
    out += float(p[x < -_EPS].sum()) - mirror[horizon - 1::-1]
    return out


def end_quantile(u: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The inverse of :func:`end_cdf`: the time (as a fraction of H) by which a share ``u`` of
    the law with rate ``x`` has ended (broadcasting)."""
    u = np.clip(np.asarray(u, dtype=np.float64), 0.0, 1.0)
    x = np.asarray(x, dtype=np.float64)
    pos = np.where(x > _EPS, x, 1.0)
    neg = np.where(x < -_EPS, -x, 1.0)
    with np.errstate(divide="ignore", under="ignore"):  # u = 1 at a steep rate: H
        rising = -np.log1p(u * np.expm1(-pos)) / pos
        falling = 1.0 + np.log(u + (1.0 - u) * np.exp(-neg)) / neg
    return np.clip(np.where(x > _EPS, rising, np.where(x < -_EPS, falling, u)), 0.0, 1.0)


def aged_law(p_fin: np.ndarray, mu_rem: np.ndarray, elapsed: np.ndarray, horizon: int,
             shape: str = END_SHAPE) -> tuple[np.ndarray, np.ndarray]:
    """A law (``p_fin``, ``mu_rem``) answered ``elapsed`` steps ago, as of now, given that the
    request is still running.

    ``shape="exponential"``: conditioned on ``T > e``. Of the share ``p_fin`` that was to end
    within the window, what has not ended by e ends within the next H - e steps, with the
    same constant hazard (the law of :func:`end_rate` is memoryless); of the share that was to
    outlive the window, a part ``1 - (1 - p_fin)^(e/H)`` now ends within it, by the hazard
    ``p_fin`` implies, about ``H - e/2`` steps from now. A request that was sure to end by now
    and has not is taken to end at the next step. ``shape="uniform"``: the previous aging,
    ``p_fin`` kept and ``mu_rem`` moved ``e`` steps closer (at least 1), which puts a
    request that outlives its answer's short ``mu_rem`` at the next step until the next
    refresh. NaN ``mu_rem`` (no law) stays NaN."""
    p_fin = np.asarray(p_fin, dtype=np.float64)
    mu_rem = np.asarray(mu_rem, dtype=np.float64)
    e = np.minimum(np.asarray(elapsed, dtype=np.float64), float(horizon))
    if shape == "uniform":
        return p_fin, np.where(np.isfinite(mu_rem), np.maximum(mu_rem - e, 1.0), mu_rem)
    p, mu = end_law(p_fin, mu_rem, horizon)
    x = end_rate(mu, horizon)
    survive = p * (1.0 - end_cdf(e / horizon, x))  # was to end in the window, not yet
    late = (1.0 - p) * -np.expm1(e / horizon * np.log1p(-np.minimum(p, 1.0 - 1e-12)))
    alive = survive + (1.0 - p)
    ending = survive + late
    left = np.maximum(horizon - e, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        p_new = np.where(alive > 1e-12, ending / alive, 1.0)
        mu_new = np.where(ending > 1e-12,
                          (survive * left * mean_fraction(x * left / horizon)
                           + late * (horizon - e / 2.0)) / ending, 1.0)
    mu_new = np.where(alive > 1e-12, np.maximum(mu_new, 1.0), 1.0)
    keep = (e <= 0) | (p <= 0)  # nothing elapsed, or nothing to end: the answer as given
    return np.where(keep, p_fin, p_new), np.where(keep, mu_rem, mu_new)


def _end_times(mu: np.ndarray, horizon: int, end_points: int, shape: str = END_SHAPE
               ) -> np.ndarray:
    """The ``end_points`` quantile midpoints of the end-time law with mean ``mu`` (see
    :func:`mixture_loads`), each below H: shape ``(n, end_points)``, ascending."""
    quantiles = (np.arange(end_points) + 0.5) / end_points
    if shape == "exponential":
        times = horizon * end_quantile(quantiles[None, :], end_rate(mu, horizon)[:, None])
        return np.minimum(times, horizon - 1e-9)
    low, high = end_window(mu, horizon)
    return np.minimum(low[:, None] + (high - low)[:, None] * quantiles[None, :],
                      horizon - 1e-9)


def projected_loads(
    workers: int,
    horizon: int,
    active_worker: np.ndarray,
    active_size: np.ndarray,
    c_hat: np.ndarray,
    weight: np.ndarray | None = None,
    refill: float | None = None,
) -> np.ndarray:
    """Loads ``L_{g,h}`` for h = 0..H, shape ``(G, H+1)``; ``weight`` scales each request
    (default 1). ``refill``: the size of the request that takes an emptied slot at once (a
    saturated fleet), growing by one token per step from the step its predecessor ended;
    ``None``: emptied slots stay empty."""
    width = horizon + 2
    if active_worker.size == 0:
        return np.zeros((workers, horizon + 1), dtype=np.float64)
    c = np.clip(np.asarray(c_hat, dtype=np.float64), 1.0, float(max(horizon, 1)))
    full = np.floor(c).astype(np.int64)  # steps 0..full-1 at weight 1
    fraction = c - full  # weight at step `full`
    capped = c >= horizon
    full[capped] = horizon + 1  # "at least H": alive through h = H (width H+2 has room)
    fraction[capped] = 0.0
    base = active_worker.astype(np.int64) * width
    ones = (np.ones(active_size.shape) if weight is None
            else np.asarray(weight, dtype=np.float64))
    size = active_size.astype(np.float64) * ones
    # Difference arrays over h: +x at 0, -x at `full`; prefix sums give the alive totals.
    starts = np.bincount(base, weights=size, minlength=workers * width)
    starts -= np.bincount(base + full, weights=size, minlength=workers * width)
    count = np.bincount(base, weights=ones, minlength=workers * width)
    count -= np.bincount(base + full, weights=ones, minlength=workers * width)
    alive_size = np.cumsum(starts.reshape(workers, width), axis=1)[:, :-1]
    alive_count = np.cumsum(count.reshape(workers, width), axis=1)[:, :-1]
    steps = np.arange(horizon + 1, dtype=np.float64)
    out = alive_size + alive_count * steps[None, :]
    partial = np.bincount(base + full, weights=fraction * (size + ones * full),
                          minlength=workers * width).reshape(workers, width)[:, :-1]
    out += partial
    if refill is not None:  # the refill shares step `full` with the partly alive request
        out += _refills(workers, horizon, base + full, np.where(capped, 0.0, ones), full,
                        refill)
        out -= np.bincount(base + full, weights=fraction * ones * refill,
                           minlength=workers * width).reshape(workers, width)[:, :-1]
    return out


def _refills(workers: int, horizon: int, where: np.ndarray, weight: np.ndarray,
             start: np.ndarray, size: float) -> np.ndarray:
    """Load of requests of ``size`` placed at step ``start`` (flat index ``where``), growing
    by one token per step: ``size + h - start`` for h >= start."""
    width = horizon + 2
    level = np.bincount(where, weights=weight * (size - start), minlength=workers * width)
    count = np.bincount(where, weights=weight, minlength=workers * width)
    level = np.cumsum(level.reshape(workers, width), axis=1)[:, :-1]
    count = np.cumsum(count.reshape(workers, width), axis=1)[:, :-1]
    return level + count * np.arange(horizon + 1, dtype=np.float64)[None, :]

