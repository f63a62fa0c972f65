"""Markdown tables for benchmarks/JOURNAL.md's sittings and the generated current page, benchmarks/RESULTS.md,
rendered from the result files themselves, so no number in either is typed by hand.

Run: python3 -m benchmarks.results_md FILE[:KEY][=COL,COL,...] ...
     python3 -m benchmarks.results_md --current > benchmarks/RESULTS.md   (the current page: benchmarks/current.py)
     python3 -m benchmarks.results_md --headlines   (README.md's performance table, from RESULTS.md as it stands)
  FILE  a JSON under benchmarks/results/ (name without .json), or a path to any JSON (ending in .json); a file
        whose top level is a list is its rows
  KEY   the list of rows inside it (default "rows")
  COLS  the columns to show, in order (default: every column of the first row), separated by commas, or by "|"
        where a column's name holds a comma; rows lacking one are left out; a dotted column (``http_steps.busy``)
        reads a field of a nested object

Numbers read as they were written: a ratio column (a quotient's name, "stream/floor", or one holding the word ratio,
vs, pct or share: ``common.is_ratio_column``) with 4 decimals, more where 4 would round it onto a 3-decimal number it is not
(``common.ratio_text``: 1.3004 is never shown as 1.300 against a 1.3 target); other floats with 3 decimals, 1
above 100; None (no floor, no samples) as "—".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import RESULTS_DIR
from benchmarks.current import cell_text, current_page, headlines

_MISSING = object()


def field(row: dict, col: str):
    """``row[col]``, or for a dotted column the nested field it names; _MISSING where there is none."""
    if col in row:
        return row[col]
    value = row
    for part in col.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell_text(field(r, c), c) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def parse(spec: str) -> tuple[Path, str, str]:
    """(path, key, columns) of ``FILE[:KEY][=COLS]``; a FILE ending in .json may itself hold ``=`` and ``,`` (the
    MoE tile tables' names do)."""
    end = spec.find(".json")
    if end >= 0:
        name, rest = spec[: end + 5], spec[end + 5 :]
    else:
        cut = min((i for i in (spec.find(":"), spec.find("=")) if i >= 0), default=len(spec))
        name, rest = spec[:cut], spec[cut:]
    key, _, cols = rest.removeprefix(":").partition("=")
    return (Path(name) if name.endswith(".json") else RESULTS_DIR / f"{name}.json"), key, cols


def render(spec: str) -> str:
    path, key, cols = parse(spec)
    data = json.loads(path.read_text())
    if isinstance(data, list):  # a file that is its rows alone (a run that wrote no environment)
        data = {"rows": data}
    rows = data.get(key or "rows", [])
    if isinstance(rows, dict):  # one object; or a merged file's ceilings, one entry a run (common.merge_rows)
        per_run = rows and all(isinstance(v, dict) and "measured_at" in v for v in rows.values())
        rows = list(rows.values()) if per_run else [rows]
    if not rows:
        return f"`{path.name}`: no rows under {key or 'rows'!r}"
    columns = cols.split("|" if "|" in cols else ",") if cols else list(rows[0])
    rows = [r for r in rows if all(field(r, c) is not _MISSING for c in columns)]  # rows that carry every column
    env = data.get("environment", {})
    where = f"results/{path.name}" if path.resolve().parent == RESULTS_DIR.resolve() else str(path)
    head = (f"`{where}` · {env.get('device', '?')} · {env.get('date', '?')} · commit {env.get('commit', '?')}" if env
            else f"`{where}` · no environment recorded in the file (the section names the run)")
    return head + "\n\n" + table(rows, columns)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("specs", nargs="*")
    p.add_argument("--current", action="store_true",
                   help="print benchmarks/RESULTS.md: the newest row per case, stale ones marked (benchmarks/current.py)")
    p.add_argument("--headlines", action="store_true",
                   help="print README.md's performance table: its cases' rows as benchmarks/RESULTS.md shows them")
    args = p.parse_args()
    if args.headlines:
        print(headlines((RESULTS_DIR.parent / "RESULTS.md").read_text()))
        return
    if args.current:
        print(current_page(), end="")
        return
    if not args.specs:
        p.error("name result files to render, or --current")
    for spec in args.specs:
        print(render(spec))
        print()


if __name__ == "__main__":
    main()
