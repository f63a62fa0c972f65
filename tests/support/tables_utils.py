"""The per-card kernel tables (graphserve/kernels/tables.py) read from folders of a test's own: the tune cache, the
shipped tables and those beside the readers, all under one root, every lookup forgotten."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from graphserve.kernels import tables


def isolate_tables(monkeypatch, root: Path, card: str | None = None) -> None:  # noqa: ANN001
    """Tables from under ``root`` only (cache/, shipped/, kernels/); with ``card``, the device's name reads as it."""
    monkeypatch.setenv("GRAPHSERVE_CACHE_DIR", str(root / "cache"))
    monkeypatch.setattr(tables, "SHIPPED_DIR", root / "shipped")
    monkeypatch.setattr(tables, "KERNELS_DIR", root / "kernels")
    if card is not None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: card)
    tables.clear()


def write_table(path: Path, data: dict | str) -> Path:
    """``data`` (JSON, or text as it is: a malformed table) at ``path``, its folders made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path
