"""One table's measurement under a time bound, with a progress bar, and where its files go.

A table is measured in units (a projection shape, an attention point, an expert shape): the deadline is
checked before each, so a table takes at most its budget plus one unit, and what was measured by then is
written (the units not reached keep their earlier entries or the defaults, and the report names them).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from graphserve.errors import ConfigError
from graphserve.kernels import tables


@dataclass
class TablePlan:
    """How one table is measured: its units in order of importance, ``measure(unit, seconds_left)`` for each,
    (``seconds_left``: its even share of the table's time left), and ``finish(results, earlier)``, which turns the measured units' results into the files to write, each
    ``(name relative to the output folder, JSON)``; ``earlier(name)`` reads a file already there, else the shipped
    table for the card (or None)."""

    table: str
    units: list[str]
    measure: Callable[[str, float], Any]
    finish: Callable[[list[tuple[str, Any]], Callable[[str], dict | None]], list[tuple[str, dict]]]


@dataclass
class TableReport:
    table: str
    measured: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # "unit: error"
    skipped: list[str] = field(default_factory=list)  # not reached within the budget
    files: list[Path] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        parts = [f"{self.table}: {len(self.measured)}/{len(self.measured) + len(self.failed) + len(self.skipped)} "
                 f"units in {self.seconds:.0f} s"]
        if self.files:
            parts.append("wrote " + ", ".join(str(f) for f in self.files))
        if self.skipped:
            parts.append(f"budget spent before {', '.join(self.skipped)} (earlier entries or defaults there)")
        if self.failed:
            parts.append("failed: " + "; ".join(self.failed))
        return "; ".join(parts)


def output_dir(out: Path | None, card: str) -> Path:
    """Where this card's tables go: the per-user cache (keyed by card and versions), or ``out/<card>`` (the shipped
    layout, ``--out graphserve/kernels/tables``). Never inside an installed package."""
    target = (out / tables.card_key(card)) if out is not None else tables.cache_dir(card)
    if tables.inside_package(target) and (out is None or tables.installed_package()):
        flag = "--out" if out is not None else "$GRAPHSERVE_CACHE_DIR"
        raise ConfigError(f"{flag} puts the tables in {target}, inside the installed graphserve package "
                          f"({tables.PACKAGE_DIR}); tables go to the per-user cache ({tables.cache_root()}) or a "
                          f"source checkout's graphserve/kernels/tables", param="out")
    return target


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)  # a reader never sees half a table


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None


def run_table(plan: TablePlan, budget_s: float, out_dir: Path, card: str,
              clock: Callable[[], float] = time.monotonic, progress: bool = True) -> TableReport:  # fmt: skip
    """Measure ``plan``'s units until ``budget_s`` is spent (the first always runs), then write its files under
    ``out_dir``, each stamped with the card and versions (kernels/tables.py checks them when reading). Each unit
    hears its even share of the time left (a unit that bounds itself, as the MoE tuner does, keeps to it)."""
    report = TableReport(plan.table)
    start = clock()
    results: list[tuple[str, Any]] = []
    with tqdm(total=len(plan.units), desc=f"tune {plan.table}", unit="unit", disable=not progress) as bar:
        for n, unit in enumerate(plan.units):
            left = budget_s - (clock() - start)
            if left <= 0 and n:
                report.skipped = plan.units[n:]
                break
            bar.set_postfix_str(unit)
            try:
                results.append((unit, plan.measure(unit, left / (len(plan.units) - n))))
                report.measured.append(unit)
            except Exception as e:  # one unit that does not compile or run here costs that unit, not the table
                report.failed.append(f"{unit}: {type(e).__name__}: {str(e)[:200]}")
            bar.update(1)
    if results:
        # a table's earlier entries: the output folder's file, else (a first tune into the cache) the shipped table
        # for this card, so shapes not measured now keep their shipped entries in the file the engine reads first
        for name, data in plan.finish(results, lambda name: read_json(out_dir / name) or tables.shipped_json(name, card)):
            path = out_dir / name
            write_json(path, {**data, **tables.stamp(card), "written_by": "graphserve tune"})
            report.files.append(path)
    report.seconds = clock() - start
    return report
