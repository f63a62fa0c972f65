"""What a model source says before its weights load: its config.json, its activations' dtype, and whether
``--tp``/``--ep`` split it. ``check_parallel`` runs before anything starts (``graphserve serve`` calls it before it
binds its port, the engine before it spawns a rank): the family's own ``describe`` splits heads, KV heads,
intermediate sizes and experts, and a split that does not divide is refused naming the field and the sizes
that would work."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from graphserve.errors import ConfigError, ModelLoadError

# The HTTP front-end imports this module (server/serve_command.py) and never imports torch: torch, the families,
# the loader and Triton behind them (seconds of imports) load inside the functions, when a split is checked.
if TYPE_CHECKING:
    import torch

    from graphserve.config import EngineConfig


def model_hf_config(source: str) -> dict[str, Any]:
    """config.json of a model source (HF folder, ``builtin:``, ``dummy:``), without loading weights."""
    from graphserve.models.builtin import ensure_builtin
    from graphserve.models.gguf_checkpoint import GGUFFile, is_gguf
    from graphserve.models.presets import get_preset_config
    from graphserve.models.trained import resolve_source

    source = resolve_source(source)
    if source.startswith("dummy:"):
        return dict(get_preset_config(source.removeprefix("dummy:")))
    if is_gguf(source):
        return GGUFFile(source).hf_config()
    folder = ensure_builtin(source.removeprefix("builtin:")) if source.startswith("builtin:") else \
        Path(source).expanduser()
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"config.json is missing from model folder {folder}", param="model")
    return json.loads(path.read_text())


def model_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype the model's activations will have on CUDA: the loader's own rule, read from config.json
    before the model is loaded."""
    import torch

    from graphserve.models.loader import resolve_dtype

    stored = model_hf_config(config.model) if config.dtype == "auto" else {}
    return resolve_dtype(config.dtype, SimpleNamespace(**stored), torch.device("cuda"))


def check_parallel(config: EngineConfig) -> None:
    """Raise ConfigError when ``--tp``/``--ep`` cannot split ``config.model``, or when its ranks (``--dp`` replicas of
    max(tp, ep) each) need more GPUs than are visible; a no-op on one rank."""
    if config.tp == 1 and config.ep == 1 and config.dp == 1:
        return
    import torch

    if config.tp > 1 or config.ep > 1:
        from graphserve.models.registry import describe_model

        hf = model_hf_config(config.model)
        try:
            description = describe_model(hf, torch.bfloat16, tp=config.tp, ep=config.ep)
        except ModelLoadError as e:
            flag = "--ep" if config.ep > 1 and ("expert" in e.message) else "--tp"
            value = config.ep if flag == "--ep" else config.tp
            raise ConfigError(f"{flag}={value} does not fit {config.model}: {e.message}", param=flag[2:]) from e
        if config.ep > 1 and not description.is_moe:
            raise ConfigError(f"--ep={config.ep} places experts on ranks, but {config.model} has no experts: "
                              f"use --tp", param="ep")
    on_cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    if on_cuda:
        check_gpu_count(config, torch.cuda.device_count())


def check_gpu_count(config: EngineConfig, visible: int) -> None:
    """On CUDA every rank of every replica takes a GPU of its own, from ``--device cuda:N`` on: refuse a split that
    needs more than the ``visible`` ones (CPU ranks share the host and are never refused here)."""
    world = max(config.tp, config.ep)
    per_node = world // config.nnodes  # EngineConfig refused a world that --nnodes does not divide
    first = int(config.device.split(":")[1]) if config.device.startswith("cuda:") else 0
    if config.dp > 1:
        need = config.dp * per_node
        if visible < first + need:
            raise ConfigError(f"--dp={config.dp} x --tp={config.tp} x --ep={config.ep} runs {config.dp} replicas of "
                              f"{world} rank(s), {need} GPUs from cuda:{first}, but {visible} GPU(s) are visible: "
                              "--dp x max(--tp, --ep) must fit the GPUs given", param="dp")
        return
    if visible < first + per_node:
        nodes = f" over --nnodes={config.nnodes} ({per_node} on this node)" if config.nnodes > 1 else ""
        raise ConfigError(f"--tp={config.tp} --ep={config.ep} runs {world} ranks{nodes}, one GPU each from "
                          f"cuda:{first}, but {visible} GPU(s) are visible: --tp x --ep must be "
                          f"--nnodes x GPUs per node", param="tp")
