"""Which layers stay in the model dtype under a quantized config, in the model's own names: the layers every
format keeps (router gates, what is dequantized at load) and the config's ignore list matched through the
family's checkpoint-name mapping (``IgnoreList``; fp4_config.py's ``GlobIgnoreList`` for ModelOpt's globs). Both
the FP8 config (config.py) and the FP4 one read it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

from graphserve.errors import ModelLoadError


class IgnoringConfig(Protocol):
    """What an ignore list reads of a quantization config (an Fp8Config or an Fp4Config)."""

    @property
    def ignored(self) -> tuple[str, ...]: ...  # checkpoint module names (or globs) kept in the model dtype

    @property
    def ignored_field(self) -> str: ...  # the config key(s) they came from, for errors

# Router gates choose experts: their logits are small and fp8 rounding flips choices; the shipped
# FP8 checkpoints keep them in bf16, and so does --quantization (gpt-oss names its gate ``mlp.router``).
ROUTER_GATES = (".gate", ".shared_expert_gate", ".router")
# Multi-head latent attention reads kv_b_proj's weight directly (absorbed into its q and output products),
# never through the layer's matmul, so it runs in the model dtype. The shipped DeepSeek-V3 FP8 checkpoints
# store it in fp8 with its scales all the same: it is dequantized as it loads (layers/quant/dequant_at_load.py).
DEQUANTIZED_AT_LOAD = (".kv_b_proj",)
MODEL_DTYPE_LAYERS = ROUTER_GATES + DEQUANTIZED_AT_LOAD  # never fp8 at run time, whatever the checkpoint stores
# the parts of one routed expert, FusedMoE's shard ids (layers/moe.py weight_shards): gate and up stacked in w13, down
GATE_UP_PARTS, DOWN_PARTS = ("w1", "w3"), ("w2",)
EXPERT_PARTS = GATE_UP_PARTS + DOWN_PARTS


class IgnoreList:
    """A config's ignored modules in the model's own names, for deciding which layers run in fp8.

    A checkpoint lists its own module names (``model.layers.0.self_attn.q_proj``, ``...mlp.experts.3.down_proj``),
    a module above them (``model.layers.0``) or their last dotted parts (``o_proj``); graphserve fuses some of them
    into one layer (qkv_proj, gate_up_proj, a layer's ``mlp.experts``). Each entry goes through the family's own
    checkpoint-name mapping (``CausalLM.map_weight_name``, what the loader places tensors by), so an entry names a
    layer whole, or one part (the loader's shard id) of a fused one. A fused layer is kept in the model dtype when
    every part is listed; some of them is refused by name, as one weight cannot be partly fp8.
    """

    FORMAT = "fp8"  # what the listed layers are not, in the refusals (layers/quant/fp4_config.py: FP4)

    def __init__(self, config: IgnoringConfig, map_weight_name: Callable[[str], tuple[str, Any] | None],
                 stacked: Mapping[str, tuple[str, Any]]) -> None:
        self.field = config.ignored_field
        self.stacked = stacked  # the family's checkpoint fragment -> (fused fragment, shard), to name unlisted parts
        self.entries: list[tuple[str, Any, str]] = []  # (module, shard or None for the whole module, entry)
        for entry in config.ignored:
            # with a leading dot, as the mapping matches fragments such as ".q_proj.": an entry that is a name's
            # last parts maps too; a tensor the family drops (a tied lm_head) names no layer
            mapped = map_weight_name(f".{entry}.weight")
            if mapped is not None:
                self.entries.append((mapped[0].removeprefix(".").rpartition(".")[0], mapped[1], entry))

    def keeps(self, name: str, shards: Collection[Any] | None = None) -> bool:
        """Whether projection ``name`` stays in the model dtype: it always does (MODEL_DTYPE_LAYERS), or the list
        names it or a module above it, or every one of its ``shards`` (a fused layer's parts, its ``weight_shards``).
        A list naming some of a fused layer's parts is refused naming the listed and the unlisted ones."""
        if name.endswith(MODEL_DTYPE_LAYERS) or self._names_whole(name):
            return True
        listed = self._listed_parts(name)
        if not listed:
            return False
        if shards is not None and set(listed) >= set(shards):
            return True
        named = " and ".join(repr(entry) for entry in dict.fromkeys(listed.values()))
        unlisted = " and ".join(self._part_names(name, shard) for shard in shards or () if shard not in listed)
        raise ModelLoadError(f"{self.field} lists {named} but not {unlisted or 'its other parts'}, which graphserve "
                             f"fuses with {'it' if len(listed) == 1 else 'them'} into {name}: list all of its parts "
                             f"(kept in the model dtype) or none ({self.FORMAT})", param="model")

    def keeps_experts(self, name: str, num_experts: int) -> bool:
        """Whether the routed experts ``name`` (one stacked tensor per layer, of ``num_experts`` in the model) stay in
        the model dtype: the list names the layer's experts whole or a module above them, or every part of every
        expert (the loader's (expert, part) ids). A list naming some of them is refused by name: one stack cannot be
        partly fp8."""
        if self._names_whole(name):
            return True
        listed = self._listed_parts(name)
        inside = [entry for module, shard, entry in self.entries if shard is None and _inside(module, name)]
        if not listed and not inside:
            return False
        if not inside and set(listed) >= {(e, part) for e in range(num_experts) for part in EXPERT_PARTS}:
            return True
        named = ", ".join(repr(entry) for entry in dict.fromkeys([*listed.values(), *inside]))
        raise ModelLoadError(f"{self.field} lists {named} of the routed experts {name}: keeping single experts "
                             f"unquantized is not supported (a layer's experts are one {self.FORMAT} stack); list {name!r} "
                             "whole to keep all of them in the model dtype, or none of them", param="model")

    def _names_whole(self, name: str) -> bool:
        return any(shard is None and _names(module, name) for module, shard, _ in self.entries)

    def _listed_parts(self, name: str) -> dict[Any, str]:
        """Shard -> the entry naming that part of fused layer ``name``."""
        return {shard: entry for module, shard, entry in self.entries
                if shard is not None and (name == module or name.endswith("." + module))}

    def _part_names(self, name: str, shard: Any) -> str:
        """The checkpoint module(s) filling part ``shard`` of fused layer ``name`` (DeepSeek's shard 0: q_proj or
        q_a_proj)."""
        path = name + "."
        names = [path[: -len(fused)] + fragment.rstrip(".") for fragment, (fused, s) in self.stacked.items()
                 if s == shard and path.endswith(fused)]
        return " / ".join(repr(n) for n in names) or f"part {shard!r}"


def _names(entry: str, name: str) -> bool:
    """Whether an ignore-list module ``entry`` names module ``name``: whole, a module above it, or its last parts."""
    return name == entry or name.startswith(entry + ".") or name.endswith("." + entry)


def _inside(entry: str, name: str) -> bool:
    """Whether ``entry`` names a module inside ``name`` (``mlp.experts.3`` inside ``model.layers.0.mlp.experts``)."""
    heads = [entry[:i] for i, c in enumerate(entry) if c == "."]
    return any(name == head or name.endswith("." + head) for head in heads)
