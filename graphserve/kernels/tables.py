"""Where the measured routing rules and tile tables come from, per card: the per-user cache that
``graphserve tune`` writes, then the tables shipped with the package, then the code defaults.

Every table is a JSON file named as its reader names it (``gemv_rule.json``, ``fp8_rule.json``,
``mla_tiles.json``, ``fp4_rule.json``, ``fp4_gemm_tiles.json``, ``fp4_moe_tiles.json``,
``moe_configs/E=...,device=....json``). Lookup, first found wins (for a table of shapes, per shape: a cache
that lists other shapes leaves the shipped table's entries in force):

1. the cache: ``<cache root>/tables/<card>/<torch-…_triton-…_graphserve-…>/<name>``. The cache root is
   ``$GRAPHSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/graphserve``, else ``~/.cache/graphserve``; never inside the
   installed package. A cached table must name this card (``device``) and the versions it was measured
   with (``versions``): a kernel's best tile moves with the Triton that compiles it.
2. shipped, per card: ``graphserve/kernels/tables/<card>/<name>`` (``graphserve tune --out graphserve/kernels/tables``).
3. shipped beside the readers: ``graphserve/kernels/<name>``, one card each (the first tables measured).

A table for another card, or (in the cache) another version, is passed over with a message naming the
file and the field; one the reader cannot parse likewise. No runtime autotuning: a table is read once
per process, before any CUDA-graph capture, so a captured grid never changes on replay.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphserve import env

logger = logging.getLogger("graphserve.tables")

KERNELS_DIR = Path(__file__).resolve().parent
PACKAGE_DIR = KERNELS_DIR.parent
SHIPPED_DIR = KERNELS_DIR / "tables"
TUNE_COMMAND = "graphserve tune"
VERSIONED = ("torch", "triton", "graphserve")  # what a cached table's tiles depend on besides the card


def card_key(name: str) -> str:
    """A card's name as a path component: ``NVIDIA H100 80GB HBM3`` -> ``NVIDIA_H100_80GB_HBM3``."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", name.strip()).strip("_") or "unknown"


def versions() -> dict[str, str]:
    import torch
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "graphserve": graphserve_version()}


@functools.lru_cache(maxsize=1)
def graphserve_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("graphserve")
    except PackageNotFoundError:  # a source tree on sys.path without an install: its pyproject says
        project = PACKAGE_DIR.parent / "pyproject.toml"
        match = re.search(r'^version = "([^"]+)"', project.read_text(), re.M) if project.is_file() else None
        return match.group(1) if match else "unknown"


def version_key(v: dict[str, str]) -> str:
    return card_key("_".join(f"{name}-{v[name]}" for name in VERSIONED))


def cache_root() -> Path:
    if env.path("GRAPHSERVE_CACHE_DIR"):
        root = env.path("GRAPHSERVE_CACHE_DIR")
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "graphserve"
    else:
        root = Path.home() / ".cache" / "graphserve"
    return root.resolve()


def cache_dir(card: str, v: dict[str, str] | None = None) -> Path:
    """The folder of this card's tables measured with versions ``v`` (default: this process's)."""
    return cache_root() / "tables" / card_key(card) / version_key(v or versions())


def inside_package(path: Path) -> bool:
    path = path.resolve()
    return path == PACKAGE_DIR or PACKAGE_DIR in path.parents


def installed_package() -> bool:
    """True where graphserve runs from an installed wheel (site-packages), not a source checkout."""
    return any(part in ("site-packages", "dist-packages") for part in PACKAGE_DIR.parts)


def stamp(card: str) -> dict[str, Any]:
    """The fields every table ``graphserve tune`` writes carries, checked when it is read back."""
    return {"device": card, "versions": versions()}


@dataclass(frozen=True)
class Found:
    """A table that serves this card: its parsed form, file and source ("cache" or "shipped")."""

    table: Any
    path: Path
    source: str


def candidates(name: str, card: str, legacy: Path | None = None) -> list[tuple[Path, str]]:
    """Where a table named ``name`` may be, in lookup order (``legacy``: the file beside its reader, when that
    is not ``kernels/<name>``)."""
    return [(cache_dir(card) / name, "cache"), (SHIPPED_DIR / card_key(card) / name, "shipped"),
            (legacy or KERNELS_DIR / name, "shipped")]  # fmt: skip


def refusal(data: Any, path: Path, card: str, source: str, v: dict[str, str] | None = None) -> str | None:
    """Why ``data`` (the JSON of ``path``) cannot serve ``card``, naming the file and field; None when it can."""
    if not isinstance(data, dict):
        return f"{path}: not a JSON object"
    device = data.get("device")
    if device is None:
        return f"{path}: field 'device' is missing (the card it was measured on)"
    if card_key(str(device)) != card_key(card):
        return f"{path}: field 'device' is {device!r}, this card is {card!r}"
    if source == "cache":
        written = data.get("versions")
        if not isinstance(written, dict):
            return f"{path}: field 'versions' is missing (the torch, triton and graphserve it was measured with)"
        v = v or versions()
        for key in VERSIONED:
            if str(written.get(key)) != v[key]:
                return f"{path}: field 'versions.{key}' is {written.get(key)!r}, this process runs {v[key]!r}"
    return None


def shipped_path(name: str, card: str) -> Path:
    """Where a benchmark run on ``card`` writes its table into the source tree: beside the reader where that file
    is absent or is this card's (the first tables measured), else ``tables/<card>/``, so that measuring another
    card never overwrites one card's table with another's."""
    beside = KERNELS_DIR / name
    try:
        device = json.loads(beside.read_text()).get("device") if beside.is_file() else None
    except (OSError, json.JSONDecodeError, AttributeError):
        device = None
    if device is None or card_key(str(device)) == card_key(card):
        return beside
    return SHIPPED_DIR / card_key(card) / name


# what each table's lookup found this process, by label: (source, path) or ("defaults", None)
RESOLVED: dict[str, tuple[str, Path | None]] = {}
_PASSED: set[str] = set()


def _pass_over(message: str, source: str) -> None:
    if message in _PASSED:
        return
    _PASSED.add(message)
    # the shipped tables of other cards are expected (one file per card); a cache entry that does not fit is not
    (logger.warning if source == "cache" else logger.info)("table passed over: %s", message)


def find(name: str, card: str, parse: Callable[[dict], Any], label: str | None = None,
         legacy: Path | None = None) -> Found | None:  # fmt: skip
    """The first table named ``name`` that serves ``card`` (cache, then shipped), parsed by ``parse``;
    None when none does (the reader's defaults). Recorded under ``label`` for the start-up line."""
    return _find(name, card, parse, label or name.removesuffix(".json"), legacy)


def find_shape(name: str, card: str, parse: Callable[[dict], Any], key: tuple, label: str, missing: str,
               tables: str) -> Any | None:
    """The entry for the shape ``key`` in the first table named ``name`` that serves ``card`` (a parsed table with a
    ``shapes`` dict), else None: the reader's defaults, recorded under ``label`` for the start-up line and logged
    with ``missing`` (what has no entry) and the command that measures it (``graphserve tune --tables TABLES``)."""
    for found in _serving(name, card, parse, None):  # the cache's entry for the shape, else the shipped one
        entry = found.table.shapes.get(key)
        if entry is not None:
            RESOLVED[label] = (found.source, found.path)
            return entry
    RESOLVED[label] = ("defaults", None)  # no table for this card, or only ones that list other shapes
    logger.info("no %s on %s; using defaults; tune with: %s --tables %s", missing, card, TUNE_COMMAND, tables)
    return None


def shipped_json(name: str, card: str) -> dict | None:
    """The JSON of the first shipped table named ``name`` that serves ``card`` (what ``graphserve tune`` merges
    its measurements into when the cache has none yet), else None."""
    for path, source in candidates(name, card)[1:]:
        data = _serving_json(path, source, card)
        if data is not None:
            return data
    return None


def _serving_json(path: Path, source: str, card: str) -> dict | None:
    """``path``'s JSON where the file is there, readable and serves ``card``; else None (the reason logged once)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        _pass_over(f"{path}: not readable JSON ({e})", source)
        return None
    why = refusal(data, path, card, source)
    if why:
        _pass_over(why, source)
        return None
    return data


def _find(name: str, card: str, parse: Callable[[dict], Any], label: str, legacy: Path | None) -> Found | None:
    serving = _serving(name, card, parse, legacy)
    RESOLVED[label] = (serving[0].source, serving[0].path) if serving else ("defaults", None)
    return serving[0] if serving else None


@functools.lru_cache(maxsize=256)
def _serving(name: str, card: str, parse: Callable[[dict], Any], legacy: Path | None) -> tuple[Found, ...]:
    """Every table named ``name`` that serves ``card``, in lookup order (those passed over are logged once)."""
    found = []
    for path, source in candidates(name, card, legacy):
        data = _serving_json(path, source, card)
        if data is None:
            continue
        try:
            table = parse(data)
        except (KeyError, TypeError, ValueError) as e:
            _pass_over(f"{path}: {type(e).__name__}: {e}", source)
            continue
        found.append(Found(table, path, source))
    return tuple(found)


# the readers' own caches of what they looked up here (gemv_config.rule_for, moe_config._load, ...): clear() forgets
# them too, or a process that just tuned would keep serving the defaults it had looked up before the tables existed
_READER_CACHES: list[Callable[[], None]] = []


def reader_cache(fn: Callable) -> Callable:
    """Registers an ``lru_cache``-wrapped reader of these tables, so ``clear`` empties it; returns it unchanged."""
    _READER_CACHES.append(fn.cache_clear)
    return fn


def clear() -> None:
    """Forget every lookup, the readers' cached ones included (tests; a process that just tuned)."""
    _serving.cache_clear()
    for forget in _READER_CACHES:
        forget()
    RESOLVED.clear()
    _PASSED.clear()


def startup_line(card: str, model: str | None = None) -> str | None:
    """One line: which tables serve this card (and from where) and which fell back to the defaults, with
    the command that measures them. None when no table was looked up (CPU, or no Triton path taken)."""
    if not RESOLVED:
        return None
    served = [f"{label} ({source})" for label, (source, _) in sorted(RESOLVED.items()) if source != "defaults"]
    defaults = sorted(label for label, (source, _) in RESOLVED.items() if source == "defaults")
    line = f"kernel tables on {card}: tuned: {', '.join(served) or 'none'}"
    if defaults:
        only = "--tables " + " ".join(sorted({d.split()[0] for d in defaults}))
        target = f" --model {model}" if model and model.startswith("dummy:") else ""  # tune measures presets' shapes
        line += f"; defaults: {', '.join(defaults)} (measure them: {TUNE_COMMAND}{target} {only})"
    return line
