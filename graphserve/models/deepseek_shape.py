"""What a DeepSeek-V2/V3 config asks for, read once and checked: anything not implemented is refused
by name at load, never run with a silent substitute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphserve.errors import ModelLoadError
from graphserve.layers.mla_rope import rope_parameters_of

# (version) -> accepted values of the routing fields; None: the field absent from the config
_TOPK_METHODS = {2: ("greedy", "group_limited_greedy"), 3: (None, "noaux_tc")}
_SCORING = {2: (None, "softmax"), 3: (None, "sigmoid")}


@dataclass(frozen=True)
class DeepseekShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: dict[str, Any]
    rope_interleave: bool
    intermediate_size: int
    moe_layers: frozenset[int]
    n_routed_experts: int
    top_k: int
    moe_intermediate_size: int
    n_shared_experts: int
    scoring_func: str  # "softmax" (V2) or "sigmoid" (V3)
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def _refuse(field: str, value: Any, allowed: str) -> ModelLoadError:
    return ModelLoadError(f"config.json {field}={value!r} is not implemented for DeepSeek models: {allowed}",
                          param="model")


def shape_from_config(config: Any, version: int) -> DeepseekShape:
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    if get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", get("hidden_act"), "only 'silu'")
    topk_method = get("topk_method")
    if topk_method not in _TOPK_METHODS[version]:
        raise _refuse("topk_method", topk_method, f"DeepSeek-V{version} takes {_TOPK_METHODS[version]}")
    scoring = get("scoring_func")
    if scoring not in _SCORING[version]:
        raise _refuse("scoring_func", scoring, f"DeepSeek-V{version} takes {_SCORING[version]}")
    norm_topk = bool(get("norm_topk_prob", False))
    if version == 2 and norm_topk:
        # transformers ignores it and DeepSeek's own V2 code renormalises and drops the scaling
        # factor: the two disagree, so no answer would be the checkpoint's
        raise _refuse("norm_topk_prob", True, "DeepSeek-V2 routing is implemented without renormalisation")
    q_lora = get("q_lora_rank")
    if get("attention_bias", False) and q_lora is None:
        raise _refuse("attention_bias", True, "a bias on kv_a_proj_with_mqa alone (q_lora_rank=None) is not supported")
    rope_interleave = True if version == 2 else bool(get("rope_interleave", True))
    n_routed = get("n_routed_experts")
    num_layers = config.num_hidden_layers
    first_dense = int(get("first_k_dense_replace", 0) or 0)
    freq = int(get("moe_layer_freq", 1) or 1)
    moe_layers = frozenset(i for i in range(num_layers) if n_routed and i >= first_dense and i % freq == 0)
    n_group = int(get("n_group", 1) or 1)
    topk_group = int(get("topk_group", 1) or 1)
    if version == 2 and topk_method == "greedy":
        n_group = topk_group = 1
    if n_routed and topk_method == "group_limited_greedy" and n_group < 2:
        raise _refuse("n_group", get("n_group"), "group_limited_greedy needs n_group >= 2")
    top_k = int(get("num_experts_per_tok", 0) or 0)
    if moe_layers and not 0 < top_k <= n_routed:
        raise _refuse("num_experts_per_tok", top_k, f"must be in 1..n_routed_experts={n_routed}")
    return DeepseekShape(
        hidden_size=config.hidden_size, num_layers=num_layers, num_heads=config.num_attention_heads,
        vocab_size=config.vocab_size, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        attention_bias=bool(get("attention_bias", False)), mlp_bias=bool(get("mlp_bias", False)),
        q_lora_rank=q_lora, kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, rope=rope_parameters_of(config),
        rope_interleave=rope_interleave, intermediate_size=config.intermediate_size, moe_layers=moe_layers,
        n_routed_experts=int(n_routed or 0), top_k=top_k, moe_intermediate_size=int(get("moe_intermediate_size", 0)),
        n_shared_experts=int(get("n_shared_experts", 0) or 0), scoring_func="sigmoid" if version == 3 else "softmax",
        n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk,
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0) or 1.0),
    )  # fmt: skip
