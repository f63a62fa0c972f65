"""The report's plots: step time and throughput against concurrency, and latency percentiles, for one
configuration or several overlaid (one colour each)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from graphserve.analysis.scaling import line_text


def stat(summary: Mapping[str, Any], metric: str, key: str) -> float:
    v = (summary.get(metric) or {}).get(key)
    return float("nan") if v is None else float(v)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scaling(views: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Left: median TPOT against achieved concurrency with each fit; right: output tok/s against C,
    with the fit's ceiling only where the fit is reliable."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    several = len(views) > 1
    for k, v in enumerate(views):
        color = f"C{k}"
        pts = v["points"]
        if not pts:
            continue
        name = f"{v['name']}: " if several else ""
        n = np.array([p.get("achieved_concurrency") or p["concurrency"] for p in pts], dtype=float)
        tpot = np.array([stat(p["summary"], "tpot_ms", "median") for p in pts])
        conc = np.array([p["concurrency"] for p in pts], dtype=float)
        thr = np.array([p["summary"].get("output_throughput", np.nan) for p in pts], dtype=float)
        ax1.plot(n, tpot, "o", color=color, label=f"{name}median TPOT")
        grid = np.linspace(0, max(np.nanmax(n), 1) * 1.05, 100)
        fit = v.get("fit") or {}
        if fit:
            a, b = fit["a_ms"], fit["b_ms"]
            ax1.plot(grid, a + b * grid, "-", color=color, label=f"{name}fit {line_text(a, b)} (R² {fit['r2']:.2f})")
            if not several:
                (a_lo, a_hi), (b_lo, b_hi) = fit["a_ci"], fit["b_ci"]
                ax1.fill_between(grid, a_lo + b_lo * grid, a_hi + b_hi * grid, color=color, alpha=0.2,
                                 label="95% interval")
        tel = v.get("telemetry_fit")
        if tel:
            ax1.plot(grid, tel["a_ms"] + tel["b_ms"] * grid, "--", color=color, label=f"{name}telemetry fit")
        ax2.plot(conc, thr, "o-", color=color, label=f"{name}output tok/s")
        if fit.get("asymptote_tok_s") and v["fit_quality"]["reliable"]:
            ax2.axhline(fit["asymptote_tok_s"], color=color, ls="--", label=f"{name}ceiling {fit['asymptote_tok_s']:.0f} tok/s")
    ax1.set_xlabel("achieved concurrency N")
    ax1.set_ylabel("step time (ms)")
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("output tok/s")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_latency(views: Sequence[Mapping[str, Any]], path: Path) -> None:
    """TTFT and TPOT percentiles against concurrency (p50/p90/p99 for one configuration, p50/p99 each
    for several, so the overlay stays readable)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    several = len(views) > 1
    stats = (("median", "p50", "-"), ("p99", "p99", ":")) if several else \
        (("median", "p50", "-"), ("p90", "p90", "-"), ("p99", "p99", "-"))
    for k, v in enumerate(views):
        pts = v["points"]
        if not pts:
            continue
        conc = [p["concurrency"] for p in pts]
        for ax, metric, label in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
            for j, (key, name, ls) in enumerate(stats):
                color = f"C{k}" if several else f"C{j}"
                prefix = f"{v['name']}: " if several else ""
                ax.plot(conc, [stat(p["summary"], metric, key) for p in pts], "o", ls=ls, color=color,
                        label=f"{prefix}{label} {name}")
    for ax, label in ((axes[0], "TTFT"), (axes[1], "TPOT")):
        ax.set_xlabel("concurrency")
        ax.set_ylabel(f"{label} (ms)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
