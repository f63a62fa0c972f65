"""Decode scaling model: step_time = a + b·N, fitted robustly, with intervals and regime breaks.

``a`` is the per-step cost that does not depend on the batch (launches, weight reads, sync);
``b`` is what each extra running request adds to every step (its KV reads, per-request
kernels). Aggregate decode throughput N·1000/(a + b·N) tok/s climbs towards ``1000/b``: when
``b`` dominates, more concurrency buys almost nothing (the 54 + 30·N ms plateau near 33 tok/s).

Fit: Huber M-estimation by iteratively reweighted least squares (k = 1.345, scale = MAD of the
residuals), so a few stalled steps (GC, a prefill sneaking in) do not drag the line. Intervals
are analytic: t quantile × standard errors of the final weighted least-squares solve.
Breaks: a Chow test at every split of the distinct N values (at least 3 distinct N each side);
the split with the largest F is reported when p < 0.01 and the two-line fit removes at least
half of the one-line residual sum of squares, i.e. only a real regime change (e.g. batches
that leave the CUDA-graph path) is called a break. Each split's test leaves out the steps more than
``OUTLIER_SCALES`` robust scales off a robust line on either side of it (stalls), as the fit itself
down-weights them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats as sps

from graphserve.analysis.stats import huber_weights, mad_scale
from graphserve.errors import BadRequestError

BREAK_P_VALUE = 0.01
BREAK_MIN_SSE_DROP = 0.5
MIN_SIDE = 3
OUTLIER_SCALES = 4.0  # a break's test leaves out steps this many robust scales off both lines


# b's 95% CI half-width over b past which the ceiling 1000/b is not pinned down by the data: the demo's
# ceiling swung between 458 and 2,097 tok/s from run to run with nothing saying so.
MAX_SLOPE_SPREAD = 0.3


def ceiling_doubt(b_ms: float, b_ci: Sequence[float]) -> str | None:
    """Why the data cannot support the ceiling 1000/b, or None when it can (or when b <= 0: no ceiling)."""
    if b_ms <= 0:
        return None
    lo, hi = b_ci
    if lo <= 0:
        return (f"b's 95% CI [{lo:.3f}, {hi:.3f}] ms reaches 0: the ceiling could be anything above "
                f"{1000.0 / hi:.0f} tok/s")
    spread = (hi - lo) / 2 / b_ms
    if spread > MAX_SLOPE_SPREAD:
        return (f"b's 95% CI is ±{spread:.0%} of b (over {MAX_SLOPE_SPREAD:.0%}): the ceiling lies anywhere in "
                f"[{1000.0 / hi:.0f}, {1000.0 / lo:.0f}] tok/s")
    return None


def line_text(a_ms: float, b_ms: float) -> str:
    """``a + b·N ms`` with the slope's sign folded in (a negative slope read "66.1 + -21.91·N")."""
    return f"{a_ms:.1f} {'-' if b_ms < 0 else '+'} {abs(b_ms):.2f}·N ms"


@dataclass
class ScalingFit:
    a_ms: float
    b_ms: float
    r2: float
    a_ci: tuple[float, float]
    b_ci: tuple[float, float]
    n_points: int
    n_range: tuple[float, float]
    breaks: list[dict[str, float]] = field(default_factory=list)

    @property
    def asymptote_tok_s(self) -> float | None:
        """Aggregate decode throughput ceiling 1000/b tok/s (None when b <= 0: no ceiling seen)."""
        return 1000.0 / self.b_ms if self.b_ms > 0 else None

    @property
    def n_at_90pct(self) -> float | None:
        """N where N·1000/(a+bN) reaches 90% of 1000/b: 0.1·b·N = 0.9·a, so N = 9a/b."""
        if self.b_ms <= 0:
            return None
        return 9.0 * max(self.a_ms, 0.0) / self.b_ms

    @property
    def ceiling_doubt(self) -> str | None:
        return ceiling_doubt(self.b_ms, self.b_ci)

    @property
    def ceiling_ci_tok_s(self) -> tuple[float, float | None] | None:
        """95% CI of the ceiling, 1000/b over b's CI (its top unbounded when b's CI reaches 0)."""
        if self.b_ms <= 0 or self.b_ci[1] <= 0:
            return None
        return 1000.0 / self.b_ci[1], (1000.0 / self.b_ci[0] if self.b_ci[0] > 0 else None)

    def step_ms(self, n: float) -> float:
        return self.a_ms + self.b_ms * n

    def throughput_tok_s(self, n: float) -> float:
        return n * 1000.0 / self.step_ms(n)

    def summary(self) -> str:
        line = f"step_time = {line_text(self.a_ms, self.b_ms)} (R² {self.r2:.3f})"
        doubt = self.ceiling_doubt
        if doubt is not None:
            line += f"; ceiling not supported by the data: {doubt}"
        elif self.asymptote_tok_s is not None:
            lo, hi = self.ceiling_ci_tok_s
            line += (f"; ceiling {self.asymptote_tok_s:.1f} tok/s (95% CI [{lo:.0f}, {hi:.0f}]), 90% of it at "
                     f"N ≈ {self.n_at_90pct:.1f}")
        for br in self.breaks:
            line += f"; break at N={br['at_n']:g}: step jumps {br['jump_ms']:+.1f} ms"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {
            "a_ms": self.a_ms,
            "b_ms": self.b_ms,
            "r2": self.r2,
            "a_ci": list(self.a_ci),
            "b_ci": list(self.b_ci),
            "asymptote_tok_s": self.asymptote_tok_s,
            "ceiling_ci_tok_s": list(self.ceiling_ci_tok_s) if self.ceiling_ci_tok_s else None,
            "ceiling_doubt": self.ceiling_doubt,
            "n_at_90pct": self.n_at_90pct,
            "n_points": self.n_points,
            "n_range": list(self.n_range),
            "breaks": list(self.breaks),
            "summary": self.summary(),
        }


def _wls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least squares of y = c0 + c1·x; returns (coef, inverse normal matrix)."""
    X = np.column_stack([np.ones_like(x), x])
    XtW = X.T * w
    inv = np.linalg.pinv(XtW @ X)
    return inv @ (XtW @ y), inv


def _huber_line(x: np.ndarray, y: np.ndarray, prior: np.ndarray, iters: int = 50):
    w = prior.copy()
    coef, inv = _wls(x, y, w)
    for _ in range(iters):
        resid = y - (coef[0] + coef[1] * x)
        scale = mad_scale(resid)
        if scale <= 1e-12:  # (near-)exact line: nothing to down-weight
            break
        w = prior * huber_weights(resid, scale)
        new, inv = _wls(x, y, w)
        if np.allclose(new, coef, rtol=1e-9, atol=1e-12):
            coef = new
            break
        coef = new
    return coef, inv, w


def _sse(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, np.ndarray]:
    coef, _ = _wls(x, y, w)
    r = y - (coef[0] + coef[1] * x)
    return float(np.sum(w * r * r)), coef


def _find_break(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> dict[str, float] | None:
    levels = np.unique(x)
    if len(levels) < 2 * MIN_SIDE or len(x) < 2 * MIN_SIDE + 1:
        return None
    best: tuple[float, int, float, float, int, np.ndarray, np.ndarray] | None = None
    for i in range(MIN_SIDE, len(levels) - MIN_SIDE + 1):
        hi = x >= levels[i]
        keep = _inliers(x, y, w, hi)
        sse_one, _ = _sse(x[keep], y[keep], w[keep])
        sse_lo, c_lo = _sse(x[keep & ~hi], y[keep & ~hi], w[keep & ~hi])
        sse_hi, c_hi = _sse(x[keep & hi], y[keep & hi], w[keep & hi])
        sse_two = sse_lo + sse_hi
        dof = int(keep.sum()) - 4
        if dof <= 0:
            continue
        f = ((sse_one - sse_two) / 2.0) / max(sse_two / dof, 1e-300)
        if best is None or f > best[0]:
            best = (f, i, sse_one, sse_two, dof, c_lo, c_hi)
    if best is None:
        return None
    f, i, sse_one, sse_two, dof, c_lo, c_hi = best
    p = float(sps.f.sf(f, 2, dof))
    if p >= BREAK_P_VALUE or sse_two > (1.0 - BREAK_MIN_SSE_DROP) * sse_one:
        return None
    at_n = float(levels[i])
    return {
        "at_n": at_n,
        "after_n": float(levels[i - 1]),
        "jump_ms": float((c_hi[0] + c_hi[1] * at_n) - (c_lo[0] + c_lo[1] * at_n)),
        "b_before_ms": float(c_lo[1]),
        "b_after_ms": float(c_hi[1]),
        "f_stat": float(f),
        "p_value": p,
    }


def _inliers(x: np.ndarray, y: np.ndarray, w: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The steps a split's Chow test counts: those within ``OUTLIER_SCALES`` robust scales of the two lines fitted
    robustly on either side of it. A few stalled steps (GC, a late timer) would otherwise weigh in both sums of
    squares by their square and hide a real break, as the one-line fit's Huber weights keep them from dragging it."""
    resid = np.empty_like(y)
    for side in (~hi, hi):
        coef, _, _ = _huber_line(x[side], y[side], w[side])
        resid[side] = y[side] - (coef[0] + coef[1] * x[side])
    scale = mad_scale(resid)
    if scale <= 1e-12:
        return np.ones_like(hi)
    return np.abs(resid) <= OUTLIER_SCALES * scale


def fit_step_time(n: Sequence[float], step_ms: Sequence[float], weights: Sequence[float] | None = None) -> ScalingFit:
    """Fit step_time = a + b·N robustly (see module docstring) and look for a regime break."""
    x = np.asarray(n, dtype=float)
    y = np.asarray(step_ms, dtype=float)
    if x.shape != y.shape:
        raise BadRequestError(f"n has {x.size} values but step_ms has {y.size}: they must pair up", param="step_ms")
    keep = np.isfinite(x) & np.isfinite(y)
    prior = np.ones_like(x) if weights is None else np.asarray(weights, dtype=float)
    keep &= np.isfinite(prior) & (prior > 0)
    x, y, prior = x[keep], y[keep], prior[keep]
    if x.size < 2 or np.unique(x).size < 2:
        raise BadRequestError(
            f"scaling fit needs at least 2 distinct N values, got {np.unique(x).size}", param="n"
        )
    coef, inv, w = _huber_line(x, y, prior)
    resid = y - (coef[0] + coef[1] * x)
    dof = max(x.size - 2, 1)
    sigma2 = float(np.sum(w * resid**2) / dof)
    se = np.sqrt(np.maximum(np.diag(inv) * sigma2, 0.0))
    t = float(sps.t.ppf(0.975, dof))
    ybar = float(np.sum(prior * y) / np.sum(prior))
    ss_tot = float(np.sum(prior * (y - ybar) ** 2))
    ss_res = float(np.sum(prior * resid**2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    brk = _find_break(x, y, prior)
    return ScalingFit(
        a_ms=float(coef[0]),
        b_ms=float(coef[1]),
        r2=float(r2),
        a_ci=(float(coef[0] - t * se[0]), float(coef[0] + t * se[0])),
        b_ci=(float(coef[1] - t * se[1]), float(coef[1] + t * se[1])),
        n_points=int(x.size),
        n_range=(float(x.min()), float(x.max())),
        breaks=[brk] if brk else [],
    )


_MISSING = object()


def _get(d: Mapping[str, Any] | Any, key: str, default: Any = None) -> Any:
    return d.get(key, default) if isinstance(d, Mapping) else getattr(d, key, default)


def fit_from_sweep(points: Iterable[Mapping[str, Any]]) -> ScalingFit:
    """Fit from per-concurrency summaries: N = achieved concurrency, step time = median TPOT.

    Each point is ``{"achieved_concurrency" (or "concurrency"), "summary": {"tpot_ms": {"median"}}}``
    or flat ``{"achieved_concurrency", "tpot_ms_median"}``. With every running request getting one
    token per decode step, TPOT is the step time seen at that concurrency. A sweep point whose
    ``tpot_ms_median`` is present but None had no steady-state window and is left out; the
    run-wide TPOT stands in only for plain bench results, which have no such key.
    """
    ns, ts = [], []
    for p in points:
        n = _get(p, "achieved_concurrency") or _get(p, "concurrency")
        tpot = _get(p, "tpot_ms_median")
        if tpot is None and _get(p, "tpot_ms_median", _MISSING) is _MISSING:
            summary = _get(p, "summary") or {}
            tpot = (_get(summary, "tpot_ms") or {}).get("median")
        if n is None or tpot is None or not math.isfinite(float(tpot)):
            continue
        ns.append(float(n))
        ts.append(float(tpot))
    return fit_step_time(ns, ts)


def fit_from_telemetry(records: Iterable[Mapping[str, Any] | Any]) -> ScalingFit:
    """Fit from per-step telemetry records (dicts or StepRecord), decode steps only."""
    ns, ts = [], []
    for r in records:
        if _get(r, "kind") != "decode":
            continue
        ns.append(float(_get(r, "batch_size")))
        ts.append(float(_get(r, "step_ms")))
    return fit_step_time(ns, ts)
