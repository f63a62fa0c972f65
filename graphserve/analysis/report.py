"""`graphserve report RESULT.json... --output-dir DIR`: results.json, scaling.png, latency.png,
report.md and a self-contained report.html (plots embedded as base64) from a sweep result or
from plain bench result files.

A configuration grid gets one section per configuration (its table, its fit with the fit's quality,
the doctor's findings on its server log, its own plots) and a comparison: overlaid plots and, per
concurrency level, a verdict with a bootstrap interval (grid_compare.py). The HTML page leads with
the answer and folds the configuration away at the end (report_html.py)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from graphserve.analysis.grid_compare import fit_quality, headline, labels
from graphserve.analysis.report_html import render_html
from graphserve.analysis.report_plots import plot_latency, plot_scaling
from graphserve.analysis.report_text import COLUMNS, fit_text, point_row, ratio_text
from graphserve.analysis.scaling import fit_from_sweep
from graphserve.analysis.slope_breakdown import breakdown_lines, breakdown_rows
from graphserve.errors import BadRequestError


def format_table(points: Sequence[Mapping[str, Any]]) -> str:
    """Console table of sweep points (latencies in ms)."""
    rows = [list(COLUMNS)] + [point_row(p) for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def _markdown_table(points: Sequence[Mapping[str, Any]]) -> str:
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    rows += ["| " + " | ".join(point_row(p)) + " |" for p in points]
    return "\n".join(rows)


def _ensure_fit(view: dict) -> None:
    if view.get("fit") or not view["points"]:
        return
    try:
        view["fit"] = fit_from_sweep(view["points"]).to_dict()
    except BadRequestError as e:
        view["fit"], view["fit_error"] = None, e.message  # fewer than two levels with a TPOT: no line


def views(sweep: Mapping[str, Any]) -> list[dict]:
    """One view per configuration (a plain sweep is one), each fit judged by grid_compare.fit_quality."""
    grid = bool(sweep.get("configurations"))
    configs = sweep["configurations"] if grid else [{**sweep, "params": {}, "status": "ok"}]
    names = labels(configs) if grid else ["sweep"]
    out = []
    for i, (c, name) in enumerate(zip(configs, names)):
        v = {**c, "name": name, "index": i, "points": sorted(c.get("points") or [], key=lambda p: p["concurrency"])}
        v["fit"] = c.get("fit") or None
        _ensure_fit(v)
        v["fit_quality"] = fit_quality(v["fit"], int((v["fit"] or {}).get("n_points") or 0))
        tel = c.get("telemetry_fit")
        distinct = c.get("telemetry_distinct_batch_sizes", (tel or {}).get("n_points") or 0)
        v["telemetry_quality"] = fit_quality(tel, int(distinct), c.get("telemetry_non_decode_share")) if tel else None
        out.append(v)
    return out


def host_share_text(shares: Mapping[str, float | None] | None) -> str | None:
    """The telemetry's host share per step kind (bench/levels.host_share) as one line; None without data."""
    known = {k: x for k, x in (shares or {}).items() if x is not None}
    if not known:
        return None
    return ("host share of a step (launch_ms / step_ms, median): " + ", ".join(f"{k} {x:.0%}" for k, x in known.items())
            + " (on a GPU, near 100% means the device waited on the host's launches; on a CPU the forward runs"
            " inside the launch)")


def doctor_text(d: Mapping[str, Any]) -> str:
    change = f"; change: {', '.join(d['flags'])}" if d["flags"] else ""
    return f"doctor [{d['severity']}]: {d['title']}{change}"


def _markdown(sweep: Mapping[str, Any], vs: Sequence[Mapping[str, Any]]) -> str:
    out = ["# graphserve sweep report", ""]
    comparison = sweep.get("comparison") or []
    if comparison:
        out += ["## Verdict", ""] + [f"- {h}" for h in headline(comparison)] + [""]
    for v in vs:
        out += [f"## {v['name']}" if len(vs) > 1 else "## Results", ""]
        if v.get("command"):
            out += [f"`{v['command']}` ({v.get('status', '')})", ""]
        if v.get("breakdown"):  # the question a --breakdown sweep was run to answer comes first
            out += [f"- {line}" for line in breakdown_lines(v["breakdown"])]
        out.append(f"- fit: {fit_text(v['fit'], v['fit_quality'], v.get('fit_error'))}")
        if v.get("telemetry_fit"):
            out.append(f"- telemetry fit (decode steps): {fit_text(v['telemetry_fit'], v['telemetry_quality'])}")
        if shares := host_share_text(v.get("telemetry_host_share")):
            out.append(f"- {shares}")
        if v.get("failed_at"):
            out.append(f"- the server died at concurrency {v['failed_at']}")
        for d in v.get("diagnosis") or []:
            out.append(f"- {doctor_text(d)}")
        out += ["", _markdown_table(v["points"]) if v["points"] else "(no measured level)", ""]
        if v.get("breakdown") and not v["breakdown"].get("error"):
            head, rows = breakdown_rows(v["breakdown"])
            out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            out += ["| " + " | ".join(r) + " |" for r in rows] + [""]
    if comparison:
        out += ["## Comparison", "", "| C | baseline | candidate | output tok/s ratio [95% CI] | TPOT p50 ratio | verdict |",
                "|---|---|---|---|---|---|"]
        for r in comparison:
            m = r["metrics"]
            out.append(f"| {r['concurrency']} | {r['baseline']} | {r['candidate']} | "
                       f"{ratio_text(m.get('output_throughput'))} | {ratio_text(m.get('tpot_p50'))} | {r['sentence']} |")
        out.append("")
    out += ["![scaling](scaling.png)", "", "![latency](latency.png)", ""]
    cfg = sweep.get("config") or {}
    if cfg:
        out += ["## Configuration", "", "```json", json.dumps(cfg, indent=2, default=str), "```", ""]
    return "\n".join(out)


def write_report(sweep: Mapping[str, Any], output_dir: str | Path, source_dir: str | Path | None = None
                 ) -> dict[str, Path]:
    """Write the report folder for a sweep (see module docstring); returns file name → path.

    ``source_dir``: the sweep's own folder, where its files (profile plots) lie, when not ``output_dir``."""
    if not sweep.get("points") and not any(c.get("points") for c in sweep.get("configurations") or []):
        raise BadRequestError("sweep has no points to report", param="points")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    sweep = dict(sweep)
    vs = views(sweep)
    if not sweep.get("configurations"):
        sweep["points"], sweep["fit"] = vs[0]["points"], vs[0]["fit"]
    paths = {name: out / name for name in ("results.json", "scaling.png", "latency.png", "report.md", "report.html")}
    paths["results.json"].write_text(json.dumps(sweep, indent=2, default=str))
    plot_scaling(vs, paths["scaling.png"])
    plot_latency(vs, paths["latency.png"])
    if len(vs) > 1:  # each configuration's own plots, beside the overlay
        for v in vs:
            for kind, plot in (("scaling", plot_scaling), ("latency", plot_latency)):
                if v["points"]:
                    name = f"cfg{v['index']}-{kind}.png"
                    paths[name] = v[f"{kind}_png"] = out / name
                    plot([v], paths[name])
    md = _markdown(sweep, vs)
    paths["report.md"].write_text(md)
    paths["report.html"].write_text(render_html(sweep, vs, paths, Path(source_dir or out)))
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
    paths = write_report(sweep, args.output_dir, source_dir=Path(args.results[0]).parent)
    print(format_table(sweep["points"]))
    print("\n".join(f"wrote {p}" for p in paths.values()))
    return 0
