"""Small statistics helpers shared by the analyzer: percentiles, bootstrap intervals, Huber weights."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Huber's tuning constant: 95% efficiency at the normal while down-weighting outliers.
HUBER_K = 1.345


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; NaN for an empty sample."""
    arr = np.asarray(values, dtype=float)
    return float(np.percentile(arr, q)) if arr.size else float("nan")


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, median, std, p90, p95, p99 of a sample (the bench summary's shape)."""
    arr = np.asarray(values, dtype=float)
    if not arr.size:
        return {k: float("nan") for k in ("mean", "median", "std", "p90", "p95", "p99")}
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "std": float(arr.std()),
        "p90": float(np.percentile(arr, 90)),
        "p95": float(np.percentile(arr, 95)),
        "p99": float(np.percentile(arr, 99)),
    }


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
