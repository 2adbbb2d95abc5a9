"""Projected per-worker loads over the next H steps (SPEC.md sections 4 and 6).

An active request with current work ``w = s + a`` reads ``w + h`` KV tokens h steps ahead if
it is still running. With ``c_hat`` its expected capped remaining life, it is taken to run at
step h with weight ``clip(c_hat - h, 0, 1)``: fully for the first ``floor(c_hat)`` steps, a
fraction on the next, not after. Since an active request always runs its next step,
``c_hat >= 1`` and the h = 0 column equals the current loads.
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
    out = np.zeros((workers, horizon + 1), dtype=np.float64)
    if active_worker.size == 0:
        return out
    steps = np.arange(horizon + 1, dtype=np.float64)
    alive = np.clip(np.maximum(c_hat, 1.0)[:, None] - steps[None, :], 0.0, 1.0)
    contribution = (active_size[:, None] + steps[None, :]) * alive
    order = np.argsort(active_worker, kind="stable")
    sorted_workers = active_worker[order]
    starts = np.flatnonzero(np.r_[True, sorted_workers[1:] != sorted_workers[:-1]])
    out[sorted_workers[starts]] = np.add.reduceat(contribution[order], starts, axis=0)
    return out
