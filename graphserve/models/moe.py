"""The mixture-of-experts decoder family: Qwen3-MoE, Mixtral, OLMoE and Qwen2-MoE.

All four keep the Llama-family attention (models/llama.py: Qwen3-MoE with per-head q/k norm,
Qwen2-MoE with q/k/v bias, OLMoE with a whole-projection q/k norm and optional clamp) and replace
the MLP of their sparse layers with a routed block: a router gate, ``top_k`` of ``num_experts``
gated-SiLU experts run through ``layers/moe.FusedMoE``, and for Qwen2-MoE a shared expert scaled by
a sigmoid gate. Which layers are sparse follows ``decoder_sparse_step`` and ``mlp_only_layers``.

Checkpoint names: each expert is stored apart (``mlp.experts.N.gate_proj/up_proj/down_proj``;
Mixtral: ``block_sparse_moe.experts.N.w1/w3/w2``); FusedMoE stacks them, so the family maps the
expert index in the name to a shard of the stacked parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphserve.distributed.comm import all_reduce
from graphserve.distributed.state import get_parallel, split_evenly
from graphserve.errors import ModelLoadError
from graphserve.layers.linear import Linear, norm_linear
from graphserve.layers.moe import FusedMoE, SoftmaxTopK, expert_split
from graphserve.layers.norm import RMSNorm
from graphserve.layers.rotary import RotaryEmbedding
from graphserve.models.base import CausalLM
from graphserve.models.description import ModelDescription, layer_modules
from graphserve.models.llama import (
    _STACKED,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    Qwen3ForCausalLM,
    Shape,
    attention_kept_params,
    attention_params,
    attention_projections,
    kv_layout_of,
    mlp_projections,
)

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch

# checkpoint expert tensor -> (stacked parameter, which part): gate/up are w1/w3, down is w2; an FP8
# checkpoint's scales (weight_scale_inv: block-wise, weight_scale: per channel or tensor) go to the
# stacked weight's scale of the same name (layers/quant/fp8_moe.py), an input_scale to one that no
# layer has, so the loader refuses it by name; NVFP4's weight_scale_2 (global) and input_scale go to the FP4
# experts' stacks of those names (layers/quant/fp4_moe.py)
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\."
                     r"(weight|weight_scale_inv|weight_scale_2|weight_scale|input_scale)$")
_EXPERT_PART = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}


def expert_param_name(name: str) -> tuple[str, tuple[int, str]] | None:
    """A checkpoint tensor of one routed expert -> (FusedMoE's stacked parameter, (expert, part)); None for
    any other tensor. Every MoE family (and DeepSeek's) stores its experts apart under these names."""
    hit = _EXPERT.search(name)
    if hit is None:
        return None
    expert, part, tensor = int(hit.group(1)), _EXPERT_PART[hit.group(2)], hit.group(3)
    stacked = "w2_" if part == "w2" else "w13_"
    return f"{name[: hit.start()]}.experts.{stacked}{tensor}", (expert, part)


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    renormalize: bool
    sparse_layers: frozenset[int]
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)


def _required(config: Any, field: str) -> Any:
    value = getattr(config, field, None)
    if value is None:
        raise ModelLoadError(f"config.json lacks {field!r}, which {type(config).__name__} needs", param="model")
    return value


class SparseMoeBlock(nn.Module):
    """Router gate + routed experts (+ an optional sigmoid-gated shared expert).

    Under ``--tp``/``--ep`` every rank routes every token and computes the pairs its experts (or expert
    slices) hold; one all-reduce of ``[T, H]`` combines the ranks. An all-to-all version of ``--ep``
    would instead send each token only to the ranks holding its routed experts and back (traffic
    ``T·top_k·H`` spread over the pairs that cross ranks, rather than every rank reducing a full
    ``[T, H]``), which pays off at prefill sizes and lets attention run data-parallel; at decode sizes
    both are latency-bound, and the all-reduce keeps attention's tensor-parallel layout unchanged."""

    def __init__(self, s: Shape, m: MoEShape) -> None:
        super().__init__()
        ps = get_parallel()
        self.gate = Linear(s.hidden_size, m.num_experts, bias=False)
        self.experts = FusedMoE(m.num_experts, m.top_k, s.hidden_size, m.moe_intermediate_size,
                                SoftmaxTopK(m.num_experts, m.top_k, renormalize=m.renormalize), **expert_split())
        # the shared expert is tensor-parallel like a dense MLP (a partial sum at --tp N); at --tp 1 with
        # --ep N it is whole on every rank, so one rank adds it before the experts' all-reduce
        self.add_shared = ps.tp_size > 1 or ps.rank == 0
        self.shared_expert = self.shared_expert_gate = None
        if m.shared_intermediate_size:
            shared = Shape(**{**s.__dict__, "intermediate_size": m.shared_intermediate_size, "mlp_bias": False})
            self.shared_expert = LlamaMLP(shared)
            self.shared_expert_gate = Linear(s.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # the router takes the gate's output in the activation dtype and computes its softmax in
        # fp32, as the checkpoints' reference implementations do; at decode sizes the gate
        # projection and the routing run as one kernel
        return self._finish(self.experts.forward_gate(x, self.gate, valid=batch.num_valid_tokens), x)

    def forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(forward(norm(x + residual)), x + residual)``; at decode sizes the add and the norm ride in the
        router's launch."""
        out, hidden, residual = self.experts.forward_add_norm_gate(x, residual, norm, self.gate,
                                                                   valid=batch.num_valid_tokens)  # fmt: skip
        return self._finish(out, hidden), residual

    def _finish(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is not None and self.add_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(out, over="experts")  # one per layer, the shared expert already in it


class MoEDecoderLayer(nn.Module):
    """Attention, then the routed block. The post-attention add and norm go to the routed block, which
    at decode sizes runs them inside the router's launch (the router and the experts both read the
    normed hidden)."""

    def __init__(self, s: Shape, m: MoEShape, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(s, layer_idx, rotary)
        self.mlp = SparseMoeBlock(s, m)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm_linear(self.input_layernorm, hidden, residual, self.self_attn.qkv_proj)
        hidden = all_reduce(self.self_attn.forward_qkv(positions, qkv, batch))
        return self.mlp.forward_add_norm(hidden, residual, self.post_attention_layernorm, batch)


def prefetch_next_qkv(layers: nn.ModuleList) -> None:
    """Each routed block's slot sum asks L2 for the next layer's qkv weight (kernels/l2_prefetch.py)."""
    for layer, after in zip(layers, layers[1:]):
        if isinstance(getattr(layer.mlp, "experts", None), FusedMoE):
            layer.mlp.experts.read_next = (after.self_attn.qkv_proj,)


class MoEForCausalLM(CausalLM):
    """Base of the four checkpoints; subclasses say how their config reads."""

    stacked_params = _STACKED

    @classmethod
    def shape_from_config(cls, config: Any) -> Shape:
        raise NotImplementedError

    @classmethod
    def moe_shape_from_config(cls, config: Any) -> MoEShape:
        num_experts = int(_required(config, "num_experts"))
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        sparse = frozenset(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
        return cls._moe_shape(config, num_experts, int(_required(config, "moe_intermediate_size")),
                              bool(getattr(config, "norm_topk_prob", False)), sparse)

    @staticmethod
    def _moe_shape(config: Any, num_experts: int, inter: int, renormalize: bool, sparse: frozenset[int],
                   shared: int = 0) -> MoEShape:
        scoring = getattr(config, "scoring_func", None)
        if scoring not in (None, "softmax"):  # never run another scoring silently as softmax
            raise ModelLoadError(f"scoring_func={scoring!r} is not implemented for {config.model_type}: "
                                 "only 'softmax' routing", param="model")
        top_k = int(_required(config, "num_experts_per_tok"))
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ModelLoadError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]",
                                 param="model")
        return MoEShape(num_experts, top_k, inter, renormalize, sparse, shared)

    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        self.config = config
        s, m = self.shape_from_config(config), self.moe_shape_from_config(config)
        self.shape, self.moe_shape = s, m

        def make_layer(i: int, rotary: RotaryEmbedding) -> nn.Module:
            return MoEDecoderLayer(s, m, i, rotary) if i in m.sparse_layers else LlamaDecoderLayer(s, i, rotary)

        self.model = LlamaModel(s, max_positions, make_layer)
        prefetch_next_qkv(self.model.layers)
        self.add_lm_head(s.hidden_size, s.vocab_size, s.tie_word_embeddings)

    def needs_row_mask(self) -> bool:
        return True

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return expert_param_name(name) or super().map_weight_name(name)

    @classmethod
    def describe(cls, config: Any, dtype: torch.dtype, tp: int = 1, ep: int = 1) -> ModelDescription:
        s, m = cls.shape_from_config(config), cls.moe_shape_from_config(config)
        h = s.hidden_size
        attn, attn_act = attention_params(s, tp)
        dense_inter = split_evenly(s.intermediate_size, tp, "intermediate_size") if len(m.sparse_layers) < \
            s.num_layers else 0
        # --ep places whole experts (each rank's experts keep their full intermediate size); --tp splits it
        moe_inter = m.moe_intermediate_size if ep > 1 else split_evenly(m.moe_intermediate_size, tp,
                                                                          "moe_intermediate_size")
        local_experts = split_evenly(m.num_experts, ep, "num_experts")
        shared_inter = m.shared_intermediate_size // tp
        n_sparse, n_dense = len(m.sparse_layers), s.num_layers - len(m.sparse_layers)
        dense = [i for i in range(s.num_layers) if i not in m.sparse_layers]
        # every sparse layer reads its router gate and shared expert whatever the routing
        sparse_fixed = m.num_experts * h + (3 * h * shared_inter + h if shared_inter else 0)
        dense_params = (s.num_layers * (attn + 2 * h) + n_dense * 3 * h * dense_inter + n_sparse * sparse_fixed + h)
        # kept in the model dtype under FP8: norms, q/k norms and biases, router and shared gates
        model_dtype = (s.num_layers * (2 * h + attention_kept_params(s, tp)) + h
                       + n_sparse * (m.num_experts * h + (h if shared_inter else 0)))
        # a token at the peak of a sparse layer: router logits, k slots of gate/up (2I) and of the
        # activated product and down output (I + H), and the shared expert's 3·I_shared
        moe_act = m.num_experts + m.top_k * (3 * moe_inter + h) + 3 * shared_inter
        return ModelDescription(
            kv=kv_layout_of(s, dtype, tp), hidden_size=h, vocab_size=s.vocab_size,
            weight_bytes_per_param=dtype.itemsize, dense_params=dense_params,
            embed_params=-(-s.vocab_size // tp) * h,
            lm_head_params=0 if s.tie_word_embeddings else -(-s.vocab_size // tp) * h,
            expert_params=3 * h * moe_inter, local_experts=local_experts, num_experts=m.num_experts, top_k=m.top_k,
            num_moe_layers=n_sparse, act_width=max(attn_act, 3 * dense_inter, moe_act),
            act_bytes_per_elem=dtype.itemsize, model_dtype_params=model_dtype,
            projections=(*attention_projections(s, tp, range(s.num_layers)), *mlp_projections(h, dense_inter, dense),
                         *mlp_projections(h, shared_inter, m.sparse_layers, "mlp.shared_expert")),
            expert_layers=layer_modules(m.sparse_layers, "mlp.experts"),
        )


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE: Qwen3 attention (per-head q/k norm), softmax top-k, ``norm_topk_prob``."""

    @classmethod
    def shape_from_config(cls, config: Any) -> Shape:
        return Qwen3ForCausalLM.shape_from_config(config)  # the dense Qwen3's attention


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE): q/k/v bias, a shared expert behind a sigmoid gate."""

    @classmethod
    def shape_from_config(cls, config: Any) -> Shape:
        return LlamaForCausalLM._shape(config, qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False)

    @classmethod
    def moe_shape_from_config(cls, config: Any) -> MoEShape:
        m = super().moe_shape_from_config(config)
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        return MoEShape(**{**m.__dict__, "shared_intermediate_size": shared})


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral: Llama attention, every layer sparse, top-k always renormalised."""

    @classmethod
    def shape_from_config(cls, config: Any) -> Shape:
        return LlamaForCausalLM._shape(config, qkv_bias=False, o_bias=False)

    @classmethod
    def moe_shape_from_config(cls, config: Any) -> MoEShape:
        experts = int(_required(config, "num_local_experts"))
        every = frozenset(range(config.num_hidden_layers))
        return cls._moe_shape(config, experts, int(config.intermediate_size), True, every)


class OlmoeForCausalLM(MoEForCausalLM):
    """OLMoE: q/k RMSNorm over the whole projection, optional q/k/v clamp, every layer sparse."""

    @classmethod
    def shape_from_config(cls, config: Any) -> Shape:
        bias = bool(getattr(config, "attention_bias", False))
        base = LlamaForCausalLM._shape(config, qkv_bias=bias, o_bias=bias)
        return Shape(**{**base.__dict__, "qk_norm_full": True, "clip_qkv": getattr(config, "clip_qkv", None)})

    @classmethod
    def moe_shape_from_config(cls, config: Any) -> MoEShape:
        every = frozenset(range(config.num_hidden_layers))
        return cls._moe_shape(config, int(_required(config, "num_experts")), int(config.intermediate_size),
                              bool(getattr(config, "norm_topk_prob", False)), every)
