"""A share of one GPU for an engine that is not alone on it (``GRAPHSERVE_GPU_MEMORY_FRACTION``).

The memory plan takes ``--mem-fraction-static`` of the device's memory and start-up then cuts the KV pool to what is
free. Two engines on one card (two test files at once, a second model beside a first) would each see the whole card,
and the first to start would take what the other needs. With the switch set, an engine process caps its allocator at
that fraction of the card (``torch.cuda.set_per_process_memory_fraction``) and plans as if the card held only that
much: its "total" is the share, its "free" the share less what this process has reserved. Rank processes of
``--tp``/``--ep`` inherit the switch through the environment and take the same share of their own cards.
"""

from __future__ import annotations

import torch

from graphserve import env
from graphserve.errors import ConfigError

_SHARE: dict[int, float] = {}


def apply_memory_share(device: torch.device) -> float | None:
    """Cap this process's allocator on ``device`` at the switch's fraction; the fraction, or None when unset."""
    text = env.get("GRAPHSERVE_GPU_MEMORY_FRACTION")
    if text is None or device.type != "cuda":
        return None
    try:
        frac = float(text)
    except ValueError:
        frac = float("nan")
    if not 0.0 < frac <= 1.0:
        raise ConfigError(f"GRAPHSERVE_GPU_MEMORY_FRACTION={text!r} is invalid: must be a fraction in (0, 1]",
                          param="GRAPHSERVE_GPU_MEMORY_FRACTION")
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(frac, index)
    _SHARE[index] = frac
    return frac


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes as this process may use them: the card's, or within its share where one is set."""
    free, total = torch.cuda.mem_get_info(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    frac = _SHARE.get(index)
    if frac is None or frac >= 1.0:
        return free, total
    cap = int(total * frac)
    return max(0, min(free, cap - torch.cuda.memory_reserved(device))), cap
