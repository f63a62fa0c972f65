"""Does a model fit this machine's memory? Asked before a CPU load allocates its weights.

`graphserve profile --model dummy:llama3-8b` on a CPU machine was killed by the kernel at 23 GB with nothing
printed: float32 weights of 8 B parameters are 32 GB. The model is built on the meta device (0.2 s for
Mixtral's 47 B parameters, nothing allocated) and its bytes are compared with the memory available now,
the container's bound included, so the refusal names both numbers within a second.
"""

from __future__ import annotations

import logging
from pathlib import Path

import psutil
import torch

from graphserve.config import EngineConfig
from graphserve.errors import ConfigError

logger = logging.getLogger(__name__)
GIB = 1 << 30
CGROUP = Path("/sys/fs/cgroup")


def available_bytes() -> int:
    """Memory a new allocation can have now: the machine's available memory, or less under a cgroup v2 bound."""
    have = psutil.virtual_memory().available
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        used = int((CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        return have
    return have if limit == "max" else min(have, max(0, int(limit) - used))


def weight_bytes(config: EngineConfig) -> tuple[int, torch.dtype]:
    """(bytes of the weights, parameters and buffers, that a CPU load of ``config.model`` allocates; their
    dtype)."""
    from graphserve.models.loader import meta_model

    model = meta_model(config)
    tensors = [*model.parameters(), *model.buffers()]
    dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
    return sum(t.numel() * t.element_size() for t in tensors), dtype


def check_host_memory(config: EngineConfig, device: torch.device) -> None:
    """Refuse a CPU load whose weights alone exceed the memory available, naming both numbers."""
    if device.type != "cpu":
        return
    need, dtype = weight_bytes(config)
    have = available_bytes()
    if need > have:
        raise ConfigError(
            f"model={config.model!r} needs {need / GIB:.1f} GiB for its weights on CPU ({str(dtype).removeprefix('torch.')}), more "
            f"than the {have / GIB:.1f} GiB of memory available on this machine: use a smaller model, "
            "--dtype bfloat16, or a GPU", param="model")
    logger.debug("host memory: the weights take %.1f GiB of %.1f GiB available", need / GIB, have / GIB)
