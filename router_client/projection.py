"""Projected per-worker loads over the next H steps (BR-H's lookahead and the c_hat predictor).

An active request with current work ``w = s + a`` reads ``w + h`` KV tokens h steps ahead if
it is still running. With ``c_hat`` its expected capped remaining life, it is taken to run at
step h with weight ``clip(c_hat - h, 0, 1)``: fully for the first ``floor(c_hat)`` steps, a
fraction on the next, not after. Since an active request always runs its next step,
``c_hat >= 1`` and the h = 0 column equals the current loads. ``c_hat = H`` means "at least
H": such a request runs at every step of the window, h = H included.
"""

from __future__ import annotations

import numpy as np

END_POINTS = 4  # points of the spread end-time law (mixture_loads); 0: the point law


def mixture_loads(
    workers: int,
    horizon: int,
    active_worker: np.ndarray,
    active_size: np.ndarray,
    p_fin: np.ndarray,
    mu_rem: np.ndarray,
    refill: float | None = None,
    end_points: int = END_POINTS,
) -> np.ndarray:
    """Expected loads when each request ends within H with probability ``p_fin``, after
    ``mu_rem`` steps on average if it does, and runs through the window otherwise.

    The law the service's (``c_hat``, ``p_fin``, ``mu_rem``) describe: weight ``1 - p_fin``
    of the request alive throughout, weight ``p_fin`` of it ending at a time T within the
    window with mean ``mu_rem``. A deterministic step at ``c_hat = (1 - p_fin) H + p_fin
    mu_rem`` would take a request that is as likely to end in 5 steps as to outlive the
    window for one that surely runs 42 steps and then surely stops.

    T is uniform with mean ``mu`` inside the window: on ``[0, 2 mu]`` when ``mu <= H/2``, on
    ``[2 mu - H, H]`` otherwise (a request with a constant hazard and a small ``p_fin`` ends
    about uniformly over the window, ``mu`` near H/2), taken at ``end_points`` quantile
    midpoints of weight ``p_fin / end_points``. ``end_points=0`` puts all of it at ``mu``
    (the point law; it treats the mean end time as known, and a router that looks a few steps
    ahead then sees no ending at all before ``mu``). The oracle does not come here: true
    lengths are a deterministic ``c_hat`` (:func:`projected_loads`).
    """
    p, mu = _law(p_fin, mu_rem, horizon)
    out = projected_loads(workers, horizon, active_worker, active_size,
                          np.full(p.shape, float(horizon)), weight=1.0 - p)
    if end_points <= 0:
        return out + projected_loads(workers, horizon, active_worker, active_size, mu,
                                     weight=p, refill=refill)
    for end in _end_times(mu, horizon, end_points):
        out += projected_loads(workers, horizon, active_worker, active_size, end,
                               weight=p / end_points, refill=refill)
    return out


def _law(p_fin: np.ndarray, mu_rem: np.ndarray, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """``p_fin`` clipped to [0, 1]; ``mu_rem`` below H, and H where unknown or ``p_fin`` is 0."""
    p = np.clip(np.asarray(p_fin, dtype=np.float64), 0.0, 1.0)
    mu = np.asarray(mu_rem, dtype=np.float64)
    mu = np.minimum(np.where(np.isfinite(mu) & (p > 0), mu, float(horizon)), horizon - 1e-9)
    return p, mu


def _end_times(mu: np.ndarray, horizon: int, end_points: int) -> list[np.ndarray]:
    """The ``end_points`` quantile midpoints of the uniform end-time law with mean ``mu``
    (see :func:`mixture_loads`), each below H."""
    low = np.where(mu <= horizon / 2, 0.0, 2.0 * mu - horizon)
    high = np.where(mu <= horizon / 2, 2.0 * mu, float(horizon))
    return [np.minimum(low + (high - low) * (j + 0.5) / end_points, horizon - 1e-9)
            for j in range(end_points)]


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


def mixture_spread(
    workers: int,
    horizon: int,
    active_worker: np.ndarray,
    active_size: np.ndarray,
    p_fin: np.ndarray,
    mu_rem: np.ndarray,
    end_points: int = END_POINTS,
) -> np.ndarray:
    """Standard deviation of each worker's load h steps ahead under the law of
    :func:`mixture_loads`, shape ``(G, H+1)``.

    Each request is taken to run at step h with probability ``q_h`` (the weight
    :func:`mixture_loads` gives it there), independently of the others, reading ``w + h``
    tokens if it does: its load has variance ``(w + h)^2 q_h (1 - q_h)``, and a worker's is the
    sum over its requests. The h = 0 column is 0 (an active request runs its next step).
    """
    if active_worker.size == 0 or horizon == 0:
        return np.zeros((workers, horizon + 1), dtype=np.float64)
    p, mu = _law(p_fin, mu_rem, horizon)
    steps = np.arange(horizon + 1, dtype=np.float64)
    ends = [mu] if end_points <= 0 else _end_times(mu, horizon, end_points)
    # alive weight of a point at t (clipped to [1, H)): 1 before floor(t), t - floor(t) at
    # floor(t), 0 after; summed over the points by difference arrays, one bincount each
    width = horizon + 2
    rows = np.arange(p.size, dtype=np.int64) * width
    delta = np.zeros(p.size * width)
    delta[rows] = float(len(ends))
    for end in ends:
        t = np.clip(end, 1.0, float(horizon))
        whole = np.floor(t).astype(np.int64)
        frac = t - whole
        delta -= np.bincount(rows + whole, weights=1.0 - frac, minlength=delta.size)
        delta -= np.bincount(rows + whole + 1, weights=frac, minlength=delta.size)
    alive = np.cumsum(delta.reshape(p.size, width), axis=1)[:, :-1] / len(ends)
    q = (1.0 - p)[:, None] + p[:, None] * alive
    work = np.asarray(active_size, dtype=np.float64)[:, None] + steps[None, :]
    variance = work * work * q * (1.0 - q)
    owner = np.asarray(active_worker, dtype=np.int64)
    order = np.argsort(owner, kind="stable")
    present, starts = np.unique(owner[order], return_index=True)
    out = np.zeros((workers, horizon + 1))
    out[present] = np.add.reduceat(variance[order], starts, axis=0)  # per-worker sums
    return np.sqrt(np.maximum(out, 0.0))
