"""What the fp8 and fp4 methods share: attaching one to every layer its config quantizes, a fused part's rows, and
a copy that refuses a checkpoint tensor of another shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from graphserve.layers.quant.config import EXPERT_PARTS

if TYPE_CHECKING:
    from graphserve.layers.linear import Linear
    from graphserve.layers.moe import FusedMoE
    from graphserve.models.base import CausalLM


def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """``loaded`` into ``target``, refused (naming both shapes) where they differ: a broadcast would hide it."""
    if target.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
    target.copy_(loaded)


def part_rows(layer: Linear, shard: int | None) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a fused layer's part ``shard`` (None: the whole layer)."""
    if shard is None:
        return 0, layer.out_features
    rows = layer.shard_rows(shard)
    return rows.start, rows.stop


def local_expert(layer: FusedMoE, param_name: str, shard: tuple[int, str]) -> int | None:
    """This rank's index of checkpoint expert ``shard`` = (expert, part), the part checked to belong in
    ``param_name`` (w1/w3 in ``w13_*``, w2 in ``w2_*``) and the expert to exist; None where another rank holds it."""
    expert, part = shard
    if part not in EXPERT_PARTS:
        raise ValueError(f"expert weight {part!r} is not one of {EXPERT_PARTS}")
    if not param_name.startswith("w2_" if part == "w2" else "w13_"):
        raise ValueError(f"expert part {part!r} does not belong in {param_name}")
    if not 0 <= expert < layer.num_experts:
        raise ValueError(f"expert index {expert} is out of range for num_experts={layer.num_experts}")
    local = expert - layer.expert_start
    return local if 0 <= local < layer.num_local_experts else None


def attach_to_linears(model: CausalLM, method: Any, ignore: Any) -> int:
    """``method.create_weights`` on every ``Linear`` that ``ignore`` does not keep (a fused layer by the checkpoint
    modules it fuses); an error names the layer. The number attached."""
    from graphserve.layers.linear import Linear

    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        shards = module.weight_shards("weight") if hasattr(module, "weight_shards") else None
        if not ignore.keeps(name, shards):
            try:
                method.create_weights(module)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
            count += 1
    return count


def attach_to_experts(model: CausalLM, ignore: Any, make_method: Callable[[], Any]) -> int:
    """One method from ``make_method`` (made only where some layer needs it) on every ``FusedMoE`` that ``ignore``
    does not keep (the layer's experts whole, or every part of each); an error names the layer. The number
    attached."""
    from graphserve.layers.moe import FusedMoE

    layers = [(name, m) for name, m in model.named_modules()
              if isinstance(m, FusedMoE) and not ignore.keeps_experts(name, m.num_experts)]  # fmt: skip
    if not layers:
        return 0
    method = make_method()
    for name, module in layers:
        try:
            method.create_weights(module)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
    return len(layers)
