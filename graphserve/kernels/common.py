"""Small facts about where kernels run, shared by the kernel wrappers."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import TypeVar

import torch

T = TypeVar("T")


def interpreting() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1, read when triton is imported).

    Kernels whose loop bounds are loaded from memory take a ``while`` form there: the interpreter
    turns ``range`` bounds into Python ints with ``int(array)``, which NumPy >= 2.4 refuses for the
    one-element arrays that scalar loads produce. Compiled kernels keep ``for`` loops, which Triton
    can software-pipeline.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another; more of them buys nothing
    return torch.cuda.get_device_properties(device).multi_processor_count


@contextlib.contextmanager
def pushed(stack: list[T], value: T) -> Iterator[None]:
    """``value`` on top of ``stack`` for the scope (a setting's scoped overrides: the top one holds)."""
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()
