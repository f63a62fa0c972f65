"""Finding and reading a checkpoint's safetensors files (single file or sharded with an index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from graphserve.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of ``folder``: those the index names, else every ``*.safetensors``."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{INDEX_FILE} in {folder} is unreadable: {e}", param="model") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f.name} (listed in {INDEX_FILE}) is missing from {folder}", param="model")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no weights in {folder}: expected model.safetensors or sharded *.safetensors", param="model")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one tensor at a time, so peak host memory is one tensor, not the checkpoint."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield name, f.get_tensor(name)
        except Exception as e:  # safetensors raises its own SafetensorError for corrupt headers
            raise ModelLoadError(f"{path.name} in {path.parent} is unreadable: {e}", param="model") from e
