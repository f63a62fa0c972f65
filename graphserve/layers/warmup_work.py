"""Launches a model's layers ask for before serving, beside the warm-up's steps (engine/warmup.py).

Some kernels pick their tile from a card's measured rule by sizes a served step has and the warm-up's steps may
not (MLA's decode tile follows the batch and the block-table width). A layer that has such a kernel answers
``warmup_work(attn_backend, kv_caches, max_model_len)`` with ``(key, run)`` pairs, asking the backend that will
serve it, so the caller names no kernel family; every layer of one shape asks for the same work, so each key runs
once. Each rank runs its own: a compile on one rank stalls the collectives of all.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from torch import nn


def run_warmup_work(model: nn.Module | None, attn_backend: Any, kv_caches: list, max_model_len: int) -> int:
    """Run the launches ``model``'s layers ask for, each key once; returns how many ran (none without a model)."""
    if model is None:
        return 0
    work: dict[Hashable, Callable[[], Any]] = {}
    for module in model.modules():
        hook = getattr(module, "warmup_work", None)
        if hook is not None:
            for key, run in hook(attn_backend, kv_caches, max_model_len):
                work.setdefault(key, run)
    for run in work.values():
        run()
    return len(work)
