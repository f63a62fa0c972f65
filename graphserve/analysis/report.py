"""`graphserve report RESULT.json... --output-dir DIR`: results.json, scaling.png, latency.png,
report.md and a self-contained report.html (plots embedded as base64) from a sweep result or
from plain bench result files."""

from __future__ import annotations

import argparse
import base64
import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from graphserve.analysis.scaling import fit_from_sweep
from graphserve.errors import BadRequestError

COLUMNS = ("C", "achieved", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ok", "failed")


def _s(summary: Mapping[str, Any], metric: str, stat: str) -> float:
    v = (summary.get(metric) or {}).get(stat)
    return float("nan") if v is None else float(v)


def _row(p: Mapping[str, Any]) -> list[str]:
    s = p.get("summary", {})
    return [f"{p.get('concurrency', '-')}", f"{p.get('achieved_concurrency', float('nan')):.1f}",
            f"{s.get('output_throughput', float('nan')):.1f}", f"{_s(s, 'ttft_ms', 'median'):.1f}",
            f"{_s(s, 'ttft_ms', 'p99'):.1f}", f"{_s(s, 'tpot_ms', 'median'):.2f}", f"{_s(s, 'tpot_ms', 'p99'):.2f}",
            f"{s.get('completed', '-')}", f"{s.get('failed', '-')}"]


def format_table(points: Sequence[Mapping[str, Any]]) -> str:
    """Console table of sweep points (latencies in ms)."""
    rows = [list(COLUMNS)] + [_row(p) for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def _markdown_table(points: Sequence[Mapping[str, Any]]) -> str:
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    rows += ["| " + " | ".join(_row(p)) + " |" for p in points]
    return "\n".join(rows)


def _plot_scaling(sweep: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sweep["points"]
    n = np.array([p.get("achieved_concurrency") or p["concurrency"] for p in pts], dtype=float)
    tpot = np.array([_s(p["summary"], "tpot_ms", "median") for p in pts])
    thr = np.array([p["summary"].get("output_throughput", np.nan) for p in pts], dtype=float)
    conc = np.array([p["concurrency"] for p in pts], dtype=float)
    fit = sweep.get("fit") or {}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(n, tpot, "o", label="median TPOT (step time)")
    grid = np.linspace(0, max(n.max(), 1) * 1.05, 100)
    if fit:
        a, b = fit["a_ms"], fit["b_ms"]
        ax1.plot(grid, a + b * grid, "-", label=f"fit {a:.1f} + {b:.2f}·N ms")
        (a_lo, a_hi), (b_lo, b_hi) = fit["a_ci"], fit["b_ci"]
        ax1.fill_between(grid, a_lo + b_lo * grid, a_hi + b_hi * grid, alpha=0.2, label="95% interval")
    tel = sweep.get("telemetry_fit")
    if tel:
        ax1.plot(grid, tel["a_ms"] + tel["b_ms"] * grid, "--", label="telemetry fit")
    ax1.set_xlabel("achieved concurrency N")
    ax1.set_ylabel("step time (ms)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot(conc, thr, "o-", label="output throughput")
    if fit and fit.get("asymptote_tok_s"):
        ax2.axhline(fit["asymptote_tok_s"], color="r", ls="--", label=f"ceiling 1000/b = {fit['asymptote_tok_s']:.1f} tok/s")
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("output tok/s")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_latency(points: Sequence[Mapping[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [p["concurrency"] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for stat, name in (("median", "p50"), ("p90", "p90"), ("p99", "p99")):
            ax.plot(conc, [_s(p["summary"], metric, stat) for p in points], "o-", label=f"{label} {name}")
        ax.set_xlabel("concurrency")
        ax.set_ylabel(f"{label} (ms)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _markdown(sweep: Mapping[str, Any]) -> str:
    fit = sweep.get("fit") or {}
    out = ["# graphserve sweep report", ""]
    cfg = sweep.get("config") or {}
    if cfg:
        out += ["## Configuration", "", "```json", json.dumps(cfg, indent=2, default=str), "```", ""]
    out += ["## Results", "", _markdown_table(sweep["points"]), ""]
    if fit:
        out += ["## Scaling model", "", f"`{fit.get('summary', '')}`", "",
                f"- a (fixed per step): {fit['a_ms']:.2f} ms, 95% CI [{fit['a_ci'][0]:.2f}, {fit['a_ci'][1]:.2f}]",
                f"- b (per running request): {fit['b_ms']:.3f} ms, 95% CI [{fit['b_ci'][0]:.3f}, {fit['b_ci'][1]:.3f}]",
                f"- R²: {fit['r2']:.4f}"]
        if fit.get("asymptote_tok_s"):
            out.append(f"- throughput ceiling 1000/b: {fit['asymptote_tok_s']:.1f} tok/s; 90% of it at N ≈ {fit['n_at_90pct']:.1f}")
        for br in fit.get("breaks", []):
            out.append(f"- regime break at N = {br['at_n']:g}: step jumps {br['jump_ms']:+.1f} ms (p = {br['p_value']:.1e})")
        out.append("")
    if sweep.get("telemetry_fit"):
        out += [f"Telemetry fit (decode steps): `{sweep['telemetry_fit'].get('summary', '')}`", ""]
    if sweep.get("configurations"):
        out += ["## Server configurations", "", _configurations_table(sweep["configurations"]), ""]
    out += ["", "![scaling](scaling.png)", "", "![latency](latency.png)", ""]
    return "\n".join(out)


def _configurations_table(configs: list[Mapping[str, Any]]) -> str:
    """Configurations side by side: the fit, its ceiling, and where (and why) a server died."""
    rows = ["| configuration | status | fit | ceiling tok/s | failed at C | diagnosis |", "|---|---|---|---|---|---|"]
    for c in configs:
        params = c.get("params") or c.get("config") or {}
        label = ", ".join(f"{k}={v}" for k, v in params.items()) if isinstance(params, Mapping) else str(params)
        fit = c.get("fit") or {}
        ceiling = fit.get("asymptote_tok_s")
        findings = c.get("diagnosis") or []
        first = findings[0] if findings else {}
        diag = first.get("title") or first.get("kind") or "" if isinstance(first, Mapping) else str(first)
        rows.append(f"| {label} | {c.get('status', '')} | {fit.get('summary', '—')} | "
                    f"{f'{ceiling:.1f}' if ceiling else '—'} | {c.get('failed_at') or '—'} | {diag or '—'} |")
    return "\n".join(rows)


def _html(md: str, images: Mapping[str, Path]) -> str:
    body = []
    for line in md.splitlines():
        if line.startswith("![") and "](" in line:
            name = line[line.index("](") + 2: -1]
            data = base64.b64encode(images[name].read_bytes()).decode()
            body.append(f'<img alt="{html.escape(name)}" src="data:image/png;base64,{data}">')
        elif line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("## "):
            body.append(f"<h2>{html.escape(line[3:])}</h2>")
        else:
            body.append(f"<pre>{html.escape(line)}</pre>" if line else "")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>graphserve report</title>"
            "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}pre{margin:0}img{max-width:100%}</style>"
            "</head><body>" + "\n".join(body) + "</body></html>")


def write_report(sweep: Mapping[str, Any], output_dir: str | Path) -> dict[str, Path]:
    """Write the five report files for a sweep (see module docstring); returns file name → path."""
    if not sweep.get("points"):
        raise BadRequestError("sweep has no points to report", param="points")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    sweep = dict(sweep)
    sweep["points"] = sorted(sweep["points"], key=lambda p: p["concurrency"])
    if not sweep.get("fit"):
        try:
            sweep["fit"] = fit_from_sweep(sweep["points"]).to_dict()
        except BadRequestError:
            sweep["fit"] = None  # fewer than two concurrency levels with TPOT: no line to fit
    paths = {name: out / name for name in ("results.json", "scaling.png", "latency.png", "report.md", "report.html")}
    paths["results.json"].write_text(json.dumps(sweep, indent=2, default=str))
    _plot_scaling(sweep, paths["scaling.png"])
    _plot_latency(sweep["points"], paths["latency.png"])
    md = _markdown(sweep)
    paths["report.md"].write_text(md)
    paths["report.html"].write_text(_html(md, {"scaling.png": paths["scaling.png"], "latency.png": paths["latency.png"]}))
    return paths


def sweep_from_results(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A sweep dict from plain bench result files, one point per file (concurrency from its config)."""
    points = []
    for r in results:
        cfg = r.get("config", {})
        s = r.get("summary", {})
        c = cfg.get("max_concurrency") or cfg.get("concurrency") or s.get("achieved_concurrency") or 1
        points.append({"concurrency": c, "achieved_concurrency": s.get("achieved_concurrency", c), "summary": s})
    return {"config": results[0].get("config", {}) if results else {}, "points": points}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", help="a sweep result (with points) or bench result files")
    parser.add_argument("--output-dir", default="report", help="folder for the report files")


def run(args: argparse.Namespace) -> int:
    docs = [json.loads(Path(p).read_text()) for p in args.results]
    sweep = docs[0] if len(docs) == 1 and "points" in docs[0] else sweep_from_results(docs)
    paths = write_report(sweep, args.output_dir)
    print(format_table(sweep["points"]))
    print("\n".join(f"wrote {p}" for p in paths.values()))
    return 0
