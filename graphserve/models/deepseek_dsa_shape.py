"""What a DeepSeek sparse-attention config (DeepSeek-V3.2, GLM-5) asks for beyond DeepSeek-V3's, read once and
checked: an indexer type, an MLP type or a field the indexer cannot work with is refused by name at load."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from graphserve.errors import ModelLoadError
from graphserve.models.deepseek_shape import DeepseekShape, shape_from_config

INDEXER_TYPES = ("full", "shared")  # "shared": the layer reuses the previous layer's selection
MLP_LAYER_TYPES = ("dense", "sparse")


@dataclass(frozen=True)
class DsaShape:
    base: DeepseekShape  # MLA, MoE and routing: DeepSeek-V3's, with the MoE layers of ``mlp_layer_types``
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]  # one per layer
    # GLM-5 rotates the indexer's rope dims as interleaved pairs, DeepSeek-V3.2 as two halves
    # (transformers: apply_rotary_pos_emb_interleave vs apply_rotary_pos_emb); MLA's own rope is interleaved in both
    index_rope_interleave: bool

    @property
    def indexer_layers(self) -> list[int]:
        """The layers that own an indexer (and an indexer key cache), in order."""
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]


def _refuse(arch: str, field: str, value: Any, allowed: str) -> ModelLoadError:
    return ModelLoadError(f"config.json {field}={value!r} is not implemented for {arch}: {allowed}", param="model")


def dsa_shape_from_config(config: Any, arch: str, index_rope_interleave: bool, shared_layers: bool) -> DsaShape:
    """``shared_layers``: whether the architecture reads ``indexer_types`` (GLM-5); DeepSeek-V3.2 indexes every
    layer."""
    base = shape_from_config(config, 3)
    n = base.num_layers
    # transformers fills mlp_layer_types from first_k_dense_replace when a config.json leaves it out
    first_dense = min(int(getattr(config, "first_k_dense_replace", 0) or 0), n)
    mlp_types = list(getattr(config, "mlp_layer_types", None) or ["dense"] * first_dense + ["sparse"] * (n - first_dense))
    if len(mlp_types) != n or any(t not in MLP_LAYER_TYPES for t in mlp_types):
        raise _refuse(arch, "mlp_layer_types", mlp_types, f"one of {MLP_LAYER_TYPES} for each of the {n} layers")
    moe_layers = frozenset(i for i, t in enumerate(mlp_types) if t == "sparse")
    if moe_layers and not 0 < base.top_k <= base.n_routed_experts:
        raise _refuse(arch, "num_experts_per_tok", base.top_k, f"must be in 1..n_routed_experts={base.n_routed_experts}")
    types = list(getattr(config, "indexer_types", None) or ["full"] * n) if shared_layers else ["full"] * n
    if len(types) != n or any(t not in INDEXER_TYPES for t in types):
        bad = next((t for t in types if t not in INDEXER_TYPES), None)
        raise _refuse(arch, "indexer_types", bad if bad is not None else types,
                      f"one of {INDEXER_TYPES} for each of the {n} layers")
    if types[0] != "full":
        raise _refuse(arch, "indexer_types[0]", types[0], "the first layer has no earlier selection to share: 'full'")
    if base.q_lora_rank is None:
        raise _refuse(arch, "q_lora_rank", None, "the indexer's queries read the q LoRA latent")
    heads, dim, topk = (int(getattr(config, f, 0) or 0) for f in ("index_n_heads", "index_head_dim", "index_topk"))
    if dim < base.qk_rope_head_dim:
        raise _refuse(arch, "index_head_dim", dim, f"its first qk_rope_head_dim={base.qk_rope_head_dim} dims are rotated")
    if heads < 1:
        raise _refuse(arch, "index_n_heads", heads, ">= 1")
    if topk < 1:
        raise _refuse(arch, "index_topk", topk, ">= 1")
    return DsaShape(base=dataclasses.replace(base, moe_layers=moe_layers), index_n_heads=heads, index_head_dim=dim,
                    index_topk=topk, indexer_types=tuple(types), index_rope_interleave=index_rope_interleave)
