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


def projected_loads(
    workers: int,
    horizon: int,
    active_worker: np.ndarray,
    active_size: np.ndarray,
    c_hat: np.ndarray,
) -> np.ndarray:
    """Loads ``L_{g,h}`` for h = 0..H, shape ``(G, H+1)``."""
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
    size = active_size.astype(np.float64)
    ones = np.ones_like(size)
    # Difference arrays over h: +x at 0, -x at `full`; prefix sums give the alive totals.
    starts = np.bincount(base, weights=size, minlength=workers * width)
    starts -= np.bincount(base + full, weights=size, minlength=workers * width)
    count = np.bincount(base, weights=ones, minlength=workers * width)
    count -= np.bincount(base + full, weights=ones, minlength=workers * width)
    alive_size = np.cumsum(starts.reshape(workers, width), axis=1)[:, :-1]
    alive_count = np.cumsum(count.reshape(workers, width), axis=1)[:, :-1]
    steps = np.arange(horizon + 1, dtype=np.float64)
    out = alive_size + alive_count * steps[None, :]
    partial = np.bincount(base + full, weights=fraction * (size + full),
                          minlength=workers * width).reshape(workers, width)[:, :-1]
    return out + partial
