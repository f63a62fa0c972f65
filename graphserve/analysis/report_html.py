"""The sweep report as an HTML page, written directly: the answer first (verdicts, each fit with its
quality and ceiling, the doctor's findings), then the comparison, one section per configuration with
its table and plots, the decode-step profiles, and the configuration folded away at the end.

Plots are embedded as base64 PNGs, so the page is one file that opens anywhere."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from graphserve.analysis.report_text import COLUMNS, fit_text, point_row, ratio_text

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1150px;margin:24px auto;padding:0 16px;
color:#1d2330;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #d8dce4;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0 1em;font-size:.92em}
th,td{border:1px solid #d8dce4;padding:4px 9px;text-align:right}th{background:#f1f3f7}
td.text,th.text{text-align:left}td:not(.text),th{white-space:nowrap}
.answer{background:#f4f8ff;border:1px solid #c9dafc;border-radius:6px;padding:10px 18px}.answer h2{margin-top:.4em}
.verdict{font-size:1.1em;font-weight:600}
.same{color:#59606e}.faster{color:#0a6b2f}.slower{color:#a3261b}.no-interval{color:#8a5a00}
.error{color:#a3261b}.warning{color:#8a5a00}.unreliable{color:#8a5a00}
img{max-width:100%;border:1px solid #eceff4;margin:.4em 0}
code,pre{background:#f5f6f8;border-radius:4px;padding:1px 4px;font-size:.88em}pre{padding:8px;overflow-x:auto}
details{margin-top:2em}summary{cursor:pointer;font-weight:600}
"""


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], text_cols: int = 1, cls: str = "") -> str:
    """A real <table>; the first ``text_cols`` columns are left-aligned text, the rest numbers."""
    def cell(tag: str, i: int, v: Any) -> str:
        align = ' class="text"' if i < text_cols else ""
        return f"<{tag}{align}>{v if isinstance(v, _Raw) else escape(str(v))}</{tag}>"

    out = [f'<table class="{cls}">' if cls else "<table>", "<thead><tr>"]
    out += [cell("th", i, h) for i, h in enumerate(head)]
    out.append("</tr></thead><tbody>")
    for r in rows:
        out.append("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


class _Raw(str):
    """Cell content that is already HTML."""


def _img(path: Path | None, alt: str) -> str:
    if path is None or not Path(path).is_file():
        return ""
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def _fit_html(label: str, fit: Mapping[str, Any] | None, quality: Mapping[str, Any] | None, error: str | None) -> str:
    cls = ' class="unreliable"' if fit and quality and not quality["reliable"] else ""
    return f"<li><b>{escape(label)}</b>: <span{cls}>{escape(fit_text(fit, quality, error))}</span></li>"


def _findings(v: Mapping[str, Any]) -> str:
    items = []
    if v.get("failed_at"):
        items.append(f'<li class="error">the server died at concurrency {v["failed_at"]}</li>')
    for d in v.get("diagnosis") or []:
        flags = ", ".join(d.get("flags") or [])
        items.append(f'<li class="{escape(d.get("severity", ""))}"><b>doctor [{escape(d.get("severity", ""))}]</b> '
                     f'{escape(d.get("title", ""))}' + (f"; change: <code>{escape(flags)}</code>" if flags else "")
                     + f'<br><small>{escape(d.get("explanation", ""))}</small></li>')
    if "diagnosis" in v and not v.get("diagnosis") and not v.get("failed_at"):
        items.append("<li>doctor: no finding in this configuration's server log</li>")
    return "<ul>" + "".join(items) + "</ul>" if items else ""


def _answer(sweep: Mapping[str, Any], vs: Sequence[Mapping[str, Any]]) -> str:
    from graphserve.analysis.grid_compare import headline

    out = ['<section class="answer" id="answer"><h2>Answer</h2>']
    comparison = sweep.get("comparison") or []
    if comparison:
        out += [f'<p class="verdict">{escape(h)}.</p>' for h in headline(comparison)]
    elif len(vs) > 1:
        out.append("<p>No level was measured by two configurations: nothing to compare.</p>")
    for v in vs:
        title = v["name"] if len(vs) > 1 else "this sweep"
        out.append(f"<p><b>{escape(title)}</b>" + (f" ({escape(v.get('status', ''))})" if len(vs) > 1 else "") + "</p>")
        out.append(_breakdown_lead(v.get("breakdown")) + "<ul>")
        out.append(_fit_html("scaling fit (median TPOT against concurrency)", v["fit"], v["fit_quality"], v.get("fit_error")))
        if v.get("telemetry_fit"):
            out.append(_fit_html("telemetry fit (decode steps)", v["telemetry_fit"], v["telemetry_quality"], None))
        out.append("</ul>" + _findings(v))
    out.append("</section>")
    return "".join(out)


def _comparison(sweep: Mapping[str, Any], paths: Mapping[str, Path]) -> str:
    rows = []
    for r in sweep.get("comparison") or []:
        m = r["metrics"]
        thr = m.get("output_throughput") or {}
        # the word only: the sentences lead the page in the answer, and in a cell they wrap the table apart
        kind = r.get("verdict", "same")
        word = _Raw(f'<span class="{kind.replace(" ", "-")}" title="{escape(r["sentence"])}">{escape(kind)}</span>')
        rows.append([r["concurrency"], r["candidate"], word, f"{thr.get('a', float('nan')):.1f}",
                     f"{thr.get('b', float('nan')):.1f}", ratio_text(thr), ratio_text(m.get("tpot_p50")),
                     ratio_text(m.get("ttft_p50"))])
    # every row compares with the first configuration: it is named once, above the table
    base = next((r["baseline"] for r in sweep.get("comparison") or []), "")
    table = (f"<p>Each configuration against the first, <b>{escape(base)}</b>:</p>"
             + _table(["C", "candidate", "verdict", "baseline tok/s", "candidate tok/s", "tok/s ratio [95% CI]",
                       "TPOT p50 ratio", "TTFT p50 ratio"], rows, text_cols=3)) if rows else ""
    note = ("<p><small>Ratios are candidate/baseline over each level's whole run, with 95% bootstrap intervals over "
            "its requests (<code>graphserve compare</code>); a TPOT or TTFT ratio below 1 is faster.</small></p>")
    return ('<section id="comparison"><h2>Comparison</h2>' + table + (note if rows else "")
            + _img(paths.get("scaling.png"), "scaling, all configurations")
            + _img(paths.get("latency.png"), "latency, all configurations") + "</section>")


def _points_table(points: Sequence[Mapping[str, Any]]) -> str:
    return _table(list(COLUMNS), [point_row(p) for p in points], text_cols=0)


def _configuration(v: Mapping[str, Any], single: bool, paths: Mapping[str, Path], source_dir: Path) -> str:
    out = [f'<section class="configuration" id="cfg{v["index"]}"><h2>{escape("Results" if single else v["name"])}</h2>']
    if v.get("command"):
        out.append(f"<p>server: <code>{escape(v['command'])}</code> — {escape(v.get('status', ''))}"
                   + (f", exit code {v['exit_code']}" if v.get("exit_code") not in (None, 0) else "") + "</p>")
    out.append(_points_table(v["points"]) if v["points"] else "<p>No level was measured.</p>")
    if single:
        out += [_img(paths.get("scaling.png"), "scaling"), _img(paths.get("latency.png"), "latency")]
    else:
        out += [_img(v.get("scaling_png"), f"scaling, {v['name']}"), _img(v.get("latency_png"), f"latency, {v['name']}")]
    if v.get("log_tail"):
        out.append("<details><summary>last lines of the server log</summary><pre>"
                   + escape("\n".join(v["log_tail"][-40:])) + "</pre></details>")
    out.append(_breakdown_table(v.get("breakdown")))
    out.append(_profiles(v, source_dir))
    out.append("</section>")
    return "".join(out)


def _breakdown_lead(bd: Mapping[str, Any] | None) -> str:
    """`sweep --breakdown`'s sentence (how much of b each category takes) and whether the slopes add up."""
    from graphserve.analysis.slope_breakdown import breakdown_lines

    lines = breakdown_lines(bd)
    if not lines:
        return ""
    if bd.get("error"):
        return f'<p class="warning">{escape(lines[0])}</p>'
    cls = "" if bd["adds_up"] else ' class="warning"'
    return (f'<p class="verdict">{escape(lines[0])}</p><p{cls}>{escape(lines[1])}</p>'
            f"<p><small>{escape(lines[2])}</small></p>")


def _breakdown_table(bd: Mapping[str, Any] | None) -> str:
    if not bd or bd.get("error"):
        return ""
    from graphserve.analysis.slope_breakdown import breakdown_rows

    head, rows = breakdown_rows(bd)
    return "<h3>What each request adds to a decode step, per category</h3>" + _table(head, rows, text_cols=1)


def _profiles(v: Mapping[str, Any], base: Path) -> str:
    if not any(p.get("profile") for p in v["points"]):
        return ""
    from graphserve.analysis.profile import attribution_note, profile_rows

    parts = []
    for p in v["points"]:
        prof = p.get("profile")
        if not prof:
            continue
        parts.append(f"<h3>Decode-step profile at C={p['concurrency']}</h3>")
        if prof.get("error"):
            parts.append(f'<p class="warning">{escape(prof["error"])}</p>')
            continue
        head, rows = profile_rows(prof)
        parts.append(_table(head, rows))
        parts += [f"<p><small>{escape(n)}</small></p>" for n in [attribution_note(prof), *prof.get("notes", [])]]
        png = prof.get("png")
        parts.append(_img(base / png if png else None, f"profile C={p['concurrency']}"))
    return "".join(parts)


def _config_block(sweep: Mapping[str, Any], vs: Sequence[Mapping[str, Any]]) -> str:
    cfg = sweep.get("config") or {}
    rows = [[k, json.dumps(v, default=str) if not isinstance(v, str) else v] for k, v in cfg.items()]
    cmds = [[v["name"], _Raw(f"<code>{escape(v['command'])}</code>")] for v in vs if v.get("command")]
    out = ["<details id=\"configuration\"><summary>Configuration</summary>"]
    if cmds:
        out += ["<h3>Server commands run</h3>", _table(["configuration", "command"], cmds, text_cols=2)]
    out += ["<h3>Sweep settings</h3>", _table(["setting", "value"], rows, text_cols=2)]
    env = sweep.get("environment") or {}
    if env:
        out += ["<h3>Environment</h3>", _table(["", ""], [[k, v] for k, v in env.items()], text_cols=2)]
    out.append("</details>")
    return "".join(out)


def render_html(sweep: Mapping[str, Any], vs: Sequence[Mapping[str, Any]], paths: Mapping[str, Path],
                source_dir: Path) -> str:
    single = len(vs) == 1
    title = "graphserve sweep report" + ("" if single else f": {len(vs)} configurations")
    body = [f"<h1>{escape(title)}</h1>", _answer(sweep, vs)]
    if not single:
        body.append(_comparison(sweep, paths))
    body += [_configuration(v, single, paths, source_dir) for v in vs]
    body.append(_config_block(sweep, vs))
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width\"><title>{escape(title)}</title>"
            f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
