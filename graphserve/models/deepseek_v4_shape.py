"""DeepSeek-V4's shape, read once from its config and refused by field where it asks for a variant not built.

transformers' ``models/deepseek_v4`` is the specification. What is built: ``layer_types`` of
``sliding_attention``, ``compressed_sparse_attention`` (CSA) and ``heavily_compressed_attention`` (HCA) at power-of-two
``compress_rates`` up to ``MAX_COMPRESS_RATE``; ``mlp_layer_types`` of ``moe`` and ``hash_moe``; ``scoring_func``
``sqrtsoftplus``; the SiLU experts with their ``swiglu_limit`` clamp; rope "default" or "yarn" for the compressed
branches (the V4 convention: yarn's attention factor stays 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphserve.errors import ModelLoadError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("moe", "hash_moe")
MAX_COMPRESS_RATE = 128
ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class V4Shape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int  # the one shared K=V latent head
    rope_dim: int  # its trailing rotated part
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    n_shared_experts: int
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    rope_main: dict[str, Any]
    rope_compress: dict[str, Any]
    tie_word_embeddings: bool
    num_nextn_predict_layers: int

    def rate(self, layer: int) -> int:
        """The layer's compression rate (0 for a sliding-only layer)."""
        return self.compress_rates.get(self.layer_types[layer], 0)

    @property
    def compressed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t != SLIDING)

    def state_floats(self, layer: int) -> int:
        """fp32 values of the layer's compressor checkpoint (one a block): online-softmax accumulators (log-sum-exp
        and weighted mean per channel) of the open groups, CSA's two (cur, next) for the latent and the indexer key,
        HCA's one for the latent (kernels/v4_reference.py)."""
        t = self.layer_types[layer]
        return 4 * (self.head_dim + self.index_head_dim) if t == CSA else 2 * self.head_dim if t == HCA else 0

    def entry_width(self, layer: int) -> int:
        """Elements of one compressed entry: the latent, and in CSA the indexer key."""
        t = self.layer_types[layer]
        return self.head_dim + self.index_head_dim if t == CSA else self.head_dim if t == HCA else 0


def _refuse(field: str, value: Any, limit: str) -> ModelLoadError:
    return ModelLoadError(f"DeepseekV4ForCausalLM: {field}={value!r} is not built: {limit}", param="model")


def _rope(config: Any, label: str) -> dict[str, Any]:
    rope = dict((getattr(config, "rope_parameters", None) or {}).get(label) or {})
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise _refuse(f"rope_parameters[{label!r}].rope_type", kind, f"choose one of {', '.join(ROPE_TYPES)}")
    if label == "main" and kind != "default":
        raise _refuse("rope_parameters['main'].rope_type", kind, "the sliding layers' rope is 'default'")
    return rope


def v4_shape_from_config(config: Any) -> V4Shape:
    g = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    n = int(g("num_hidden_layers"))
    layer_types = tuple(g("layer_types") or ())
    mlp_types = tuple(g("mlp_layer_types") or ())
    for field, types, allowed in (("layer_types", layer_types, LAYER_TYPES),
                                  ("mlp_layer_types", mlp_types, MLP_LAYER_TYPES)):  # fmt: skip
        if len(types) != n:
            raise _refuse(field, list(types), f"one entry per layer (num_hidden_layers={n})")
        for i, t in enumerate(types):
            if t not in allowed:
                raise _refuse(f"{field}[{i}]", t, f"choose one of {', '.join(allowed)}")
    rates = {k: int(v) for k, v in (g("compress_rates") or {}).items()}
    for t in set(layer_types) - {SLIDING}:
        r = rates.get(t)
        if r is None or r < 2 or r > MAX_COMPRESS_RATE or r & (r - 1):
            raise _refuse(f"compress_rates[{t!r}]", r, f"a power of two in 2..{MAX_COMPRESS_RATE}")
    if g("scoring_func") != "sqrtsoftplus":
        raise _refuse("scoring_func", g("scoring_func"), "choose 'sqrtsoftplus'")
    if g("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", g("hidden_act"), "choose 'silu' (the experts' clamped SwiGLU)")
    if int(g("num_key_value_heads", 1)) != 1:
        raise _refuse("num_key_value_heads", g("num_key_value_heads"), "V4 attention has one shared K=V head")
    if g("attention_bias", False) or g("mlp_bias", False):
        raise _refuse("attention_bias/mlp_bias", True, "V4's projections have no bias")
    heads, head_dim, groups = int(g("num_attention_heads")), int(g("head_dim")), int(g("o_groups"))
    if heads % groups:
        raise _refuse("o_groups", groups, f"must divide num_attention_heads={heads}")
    rope_dim = int(g("qk_rope_head_dim", 0) or head_dim * float(g("partial_rotary_factor")))
    index_head_dim = int(g("index_head_dim"))
    if rope_dim % 2 or not 0 < rope_dim <= min(head_dim, index_head_dim if CSA in layer_types else head_dim):
        raise _refuse("partial_rotary_factor", g("partial_rotary_factor"),
                      f"the rope part ({rope_dim}) must be even and fit head_dim and index_head_dim")
    window = int(g("sliding_window"))
    if window < 1:
        raise _refuse("sliding_window", window, "at least 1")
    experts, top_k = int(g("n_routed_experts")), int(g("num_experts_per_tok"))
    if not 0 < top_k <= experts:
        raise _refuse("num_experts_per_tok", top_k, f"1..n_routed_experts={experts}")
    if not g("norm_topk_prob", True):
        raise _refuse("norm_topk_prob", False, "V4 routing renormalises its top-k weights")
    return V4Shape(
        vocab_size=int(g("vocab_size")), hidden_size=int(g("hidden_size")), num_layers=n, num_heads=heads,
        head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=int(g("q_lora_rank")), o_groups=groups,
        o_lora_rank=int(g("o_lora_rank")), layer_types=layer_types, mlp_layer_types=mlp_types,
        compress_rates=rates, sliding_window=window, index_n_heads=int(g("index_n_heads")),
        index_head_dim=index_head_dim, index_topk=int(g("index_topk")), hc_mult=int(g("hc_mult")),
        hc_sinkhorn_iters=int(g("hc_sinkhorn_iters")), hc_eps=float(g("hc_eps")), num_experts=experts, top_k=top_k,
        moe_intermediate_size=int(g("moe_intermediate_size")), n_shared_experts=int(g("n_shared_experts", 1)),
        routed_scaling_factor=float(g("routed_scaling_factor")), swiglu_limit=float(g("swiglu_limit")),
        rms_norm_eps=float(g("rms_norm_eps")), rope_main=_rope(config, "main"), rope_compress=_rope(config, "compress"),
        tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        num_nextn_predict_layers=int(g("num_nextn_predict_layers", 0) or 0),
    )  # fmt: skip
