"""The text both reports write (report.py's Markdown and console table, report_html.py's page): a sweep
point's row, a fit as a sentence, an A/B ratio with its interval."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graphserve.analysis.report_plots import stat
from graphserve.analysis.scaling import line_text

COLUMNS = ("C", "achieved", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ok", "failed")


def point_row(p: Mapping[str, Any]) -> list[str]:
    s = p.get("summary", {})
    return [f"{p.get('concurrency', '-')}", f"{p.get('achieved_concurrency', float('nan')):.1f}",
            f"{s.get('output_throughput', float('nan')):.1f}", f"{stat(s, 'ttft_ms', 'median'):.1f}",
            f"{stat(s, 'ttft_ms', 'p99'):.1f}", f"{stat(s, 'tpot_ms', 'median'):.2f}", f"{stat(s, 'tpot_ms', 'p99'):.2f}",
            f"{s.get('completed', '-')}", f"{s.get('failed', '-')}"]


def fit_text(fit: Mapping[str, Any] | None, quality: Mapping[str, Any] | None, error: str | None = None) -> str:
    """The fit as a sentence: with its ceiling where it can be trusted, otherwise why it cannot."""
    if not fit:
        return f"no fit ({error})" if error else "no fit"
    line = (f"step_time = {line_text(fit['a_ms'], fit['b_ms'])} (R² {fit['r2']:.2f}, "
            f"b 95% CI [{fit['b_ci'][0]:.3f}, {fit['b_ci'][1]:.3f}])")
    if quality and not quality["reliable"]:
        return line + "; unreliable, no ceiling quoted: " + "; ".join(quality["reasons"])
    if fit.get("asymptote_tok_s"):
        line += f"; ceiling 1000/b = {fit['asymptote_tok_s']:.1f} tok/s"
        if fit.get("ceiling_ci_tok_s"):
            lo, hi = fit["ceiling_ci_tok_s"]
            line += f" (95% CI [{lo:.0f}, {'∞' if hi is None else f'{hi:.0f}'}])"
        line += f", 90% of it at N ≈ {fit['n_at_90pct']:.1f}"
        if quality:
            line += "; fit reliable (R², the slope's interval and the batch sizes seen all pass)"
    for br in fit.get("breaks", []):
        line += f"; regime break at N = {br['at_n']:g}: step jumps {br['jump_ms']:+.1f} ms (p = {br['p_value']:.1e})"
    return line


def ratio_text(m: Mapping[str, Any] | None) -> str:
    return "—" if not m else f"{m['ratio']:.2f}× [{m['ratio_ci'][0]:.2f}, {m['ratio_ci'][1]:.2f}]"
