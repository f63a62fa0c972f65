"""Small statistics helpers shared by the analyzer: bootstrap intervals and Huber weights."""

from __future__ import annotations

import numpy as np

# Huber's tuning constant: 95% efficiency at the normal while down-weighting outliers.
HUBER_K = 1.345


def interval(draws: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of ``draws`` (NaNs dropped)."""
    d = np.asarray(draws, dtype=float)
    d = d[np.isfinite(d)]
    if not d.size:
        return (float("nan"), float("nan"))
    tail = (1.0 - level) / 2.0 * 100.0
    return (float(np.percentile(d, tail)), float(np.percentile(d, 100.0 - tail)))


def mad_scale(residuals: np.ndarray) -> float:
    """Robust scale: median absolute deviation scaled to the normal's sigma."""
    r = np.asarray(residuals, dtype=float)
    return float(1.4826 * np.median(np.abs(r - np.median(r)))) if r.size else 0.0


def huber_weights(residuals: np.ndarray, scale: float, k: float = HUBER_K) -> np.ndarray:
    """IRLS weights of Huber's loss: 1 inside k·scale, k·scale/|r| outside."""
    r = np.abs(np.asarray(residuals, dtype=float))
    if scale <= 0:
        return np.ones_like(r)
    cut = k * scale
    w = np.ones_like(r)
    big = r > cut
    w[big] = cut / r[big]
    return w
