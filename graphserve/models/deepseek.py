"""The DeepSeek family: DeepSeek-V2 / V2-Lite and DeepSeek-V3 / R1 (and checkpoints of their architecture).

Every layer attends with multi-head latent attention (layers/mla.py) over a latent KV cache; its
MLP is dense for the first ``first_k_dense_replace`` layers and a mixture of experts after them
(every ``moe_layer_freq``-th layer, as the checkpoints' own modeling code counts): a router gate,
``num_experts_per_tok`` of ``n_routed_experts`` gated-SiLU experts (layers/moe.FusedMoE) and
``n_shared_experts`` experts' worth of always-on shared MLP. V2 routes by softmax (``greedy`` or
``group_limited_greedy``), V3 by sigmoid plus ``e_score_correction_bias`` over groups (``noaux_tc``).

Under ``--tp`` attention splits by heads over a replicated latent cache (layers/mla.py), dense MLPs
and shared experts split along their intermediate size, and routed experts split along theirs or, with
``--ep``, are placed whole (as in models/moe.py). Each layer issues two all-reduces: one after
attention, one after the MLP or after the MoE block with its shared experts already added.

FP8 checkpoints (DeepSeek-V3 / R1's) load their projections and routed experts in fp8 (layers/quant);
their ``kv_b_proj``, stored in fp8 too, is dequantized to the model dtype as it loads, since attention
reads it through per-head views (layers/mla.py, layers/quant/dequant_at_load.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphserve.distributed.comm import all_reduce
from graphserve.distributed.state import get_parallel, split_evenly
from graphserve.layers.embedding import VocabEmbedding
from graphserve.layers.kv_layout import KVLayout
from graphserve.layers.linear import (
    Linear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    norm_linear,
    norm_mlp,
    silu_mul_linear,
)
from graphserve.layers.mla import MLAttention
from graphserve.layers.mla_rope import DeepseekRotary, softmax_scale
from graphserve.layers.moe import FusedMoE, GroupedSigmoidTopK, Router, SoftmaxTopK, expert_split
from graphserve.layers.moe_router_deepseek import SoftmaxGroupTopK
from graphserve.layers.norm import RMSNorm
from graphserve.layers.quant.config import DEQUANTIZED_AT_LOAD, parse_quantization_config
from graphserve.layers.quant.dequant_at_load import dequantize_at_load
from graphserve.models.base import CausalLM, DecoderStack
from graphserve.models.deepseek_shape import DeepseekShape, shape_from_config
from graphserve.models.description import ModelDescription, Projection, layer_modules
from graphserve.models.llama import mlp_projections
from graphserve.models.moe import expert_param_name

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch

_STACKED = {
    ".q_proj.": (".fused_qkv_a_proj.", 0),
    ".q_a_proj.": (".fused_qkv_a_proj.", 0),
    ".kv_a_proj_with_mqa.": (".fused_qkv_a_proj.", 1),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekMLP(nn.Module):
    """A gated-SiLU MLP: the dense layers' MLP, and the shared experts (n_shared of them as one), over this
    rank's slice of the intermediate size; the caller all-reduces its output."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        tp_rank, tp = get_parallel().tp_rank, get_parallel().tp_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias, tp_rank, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp_rank, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_mul_linear(self.gate_up_proj(x), self.down_proj)


class DeepseekMoE(nn.Module):
    """Router gate, routed experts and shared experts; returns the all-reduced sum of the ranks' parts.

    Every rank routes every token (the gate and the correction bias are replicated). ``--tp`` splits each
    routed expert along its intermediate size, ``--ep`` places whole experts. The shared experts split
    like a dense MLP at ``--tp N``; at ``--tp 1 --ep N`` they are whole on every rank and rank 0 alone
    adds them, so the one all-reduce counts them once.

    V2's ``greedy`` routing is a plain softmax top-k without renormalisation, which the fused gate kernel
    (kernels/moe_gate.py) computes: at decode sizes the post-attention add + norm, the gate projection and
    the routing are one launch. That kernel has no scaling factor, and the routed sum is linear in the
    weights, so ``routed_scaling_factor`` scales the routed output instead of the weights (1.0 for
    V2-Lite: nothing to do), folded into the shared experts' add. ``group_limited_greedy`` and V3's
    grouped sigmoid keep their own routers, which scale the weights."""

    def __init__(self, s: DeepseekShape) -> None:
        super().__init__()
        ps = get_parallel()
        self.gate = Linear(s.hidden_size, s.n_routed_experts, bias=False)
        self.routed_scale = 1.0  # what the router leaves to the output
        router: Router
        if s.scoring_func == "sigmoid":
            router = GroupedSigmoidTopK(s.n_routed_experts, s.top_k, s.n_group, s.topk_group, s.norm_topk_prob,
                                        s.routed_scaling_factor)
        elif s.n_group == 1:  # greedy
            router = SoftmaxTopK(s.n_routed_experts, s.top_k, renormalize=False)
            self.routed_scale = s.routed_scaling_factor
        else:
            router = SoftmaxGroupTopK(s.n_routed_experts, s.top_k, s.n_group, s.topk_group, s.routed_scaling_factor)
        self.experts = FusedMoE(s.n_routed_experts, s.top_k, s.hidden_size, s.moe_intermediate_size, router,
                                **expert_split())
        self.add_shared = ps.tp_size > 1 or ps.rank == 0
        self.shared_experts = None
        if s.n_shared_experts:
            self.shared_experts = DeepseekMLP(s.hidden_size, s.moe_intermediate_size * s.n_shared_experts, s.mlp_bias)

    def forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(moe(norm(x + residual)), x + residual)``. Where the router is the fused gate's (greedy, at decode
        sizes) the add and the norm ride in its launch; otherwise the norm runs first and the routers score
        in fp32 from the gate's output as it is (the routing kernels convert as they load)."""
        out, hidden, residual = self.experts.forward_add_norm_gate(x, residual, norm, self.gate,
                                                                   valid=batch.num_valid_tokens)  # fmt: skip
        if self.shared_experts is not None and self.add_shared:
            # one launch either way: the scaled routed sum added to the shared experts' output
            out = torch.add(self.shared_experts(hidden), out, alpha=self.routed_scale)
        elif self.routed_scale != 1.0:
            out = out * self.routed_scale
        return all_reduce(out, over="experts"), residual


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, s: DeepseekShape, layer_idx: int, rotary: DeepseekRotary) -> None:
        super().__init__()
        self.self_attn = MLAttention(
            s.hidden_size, s.num_heads, s.q_lora_rank, s.kv_lora_rank, s.qk_nope_head_dim, s.qk_rope_head_dim,
            s.v_head_dim, s.attention_bias, rotary, softmax_scale(s.qk_nope_head_dim + s.qk_rope_head_dim, s.rope),
            layer_idx, get_parallel().tp_rank, get_parallel().tp_size,
        )  # fmt: skip
        self.is_moe = layer_idx in s.moe_layers
        self.mlp = DeepseekMoE(s) if self.is_moe else DeepseekMLP(s.hidden_size, s.intermediate_size, s.mlp_bias)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused, residual = norm_linear(self.input_layernorm, hidden, residual, self.self_attn.fused_qkv_a_proj)
        # attention and the MLP return partial sums under --tp: one all-reduce each (no-ops at tp 1);
        # the MoE block reduces its own output, over the expert ranks
        hidden = all_reduce(self.self_attn(positions, fused, batch))
        if self.is_moe:  # the router, the routed and the shared experts all read the normed input
            return self.mlp.forward_add_norm(hidden, residual, self.post_attention_layernorm, batch)
        out, residual = norm_mlp(self.post_attention_layernorm, hidden, residual, self.mlp.gate_up_proj,
                                 self.mlp.down_proj)
        return all_reduce(out), residual


class DeepseekModel(DecoderStack):
    def __init__(self, s: DeepseekShape, max_positions: int) -> None:
        super().__init__()
        ps = get_parallel()
        self.embed_tokens = VocabEmbedding(s.vocab_size, s.hidden_size, ps.tp_rank, ps.tp_size)
        self.rotary_emb = DeepseekRotary(s.qk_rope_head_dim, max_positions, s.rope, s.max_position_embeddings,
                                         s.rope_interleave)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(s, i, self.rotary_emb) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class DeepseekV2ForCausalLM(CausalLM):
    """DeepSeek-V2 and V2-Lite: softmax routing (greedy or group-limited), q LoRA optional."""

    stacked_params = _STACKED
    version = 2
    # modules whose fp8 checkpoint weights are dequantized to the model dtype as they load
    dequantized_at_load = DEQUANTIZED_AT_LOAD

    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_model(config, max_positions)
        self.add_lm_head(self.shape.hidden_size, self.shape.vocab_size, self.shape.tie_word_embeddings)
        # how the checkpoint's tensors are stored (None: unquantized), which says how its kv_b_proj is scaled
        self.checkpoint_quant = parse_quantization_config(getattr(config, "quantization_config", None))

    def build_model(self, config: Any, max_positions: int) -> nn.Module:
        """The decoder stack; sets ``self.shape`` (a family with sparse attention builds its own:
        models/deepseek_dsa.py)."""
        self.shape = shape_from_config(config, self.version)
        return DeepseekModel(self.shape, max_positions)

    @classmethod
    def config_shape(cls, config: Any) -> DeepseekShape:
        """What ``describe`` counts by: the config's MLA and MoE shape (a sparse-attention family's MoE layers
        follow its ``mlp_layer_types``: models/deepseek_dsa.py)."""
        return shape_from_config(config, cls.version)

    def needs_row_mask(self) -> bool:
        return bool(self.shape.moe_layers)

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= self.shape.num_layers:
            return None  # V3's multi-token-prediction layers sit past the last decoder layer; unused here
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.experts.router.e_score_correction_bias")
        return expert_param_name(name) or super().map_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As every family loads, with an fp8 ``kv_b_proj`` dequantized on the way; the tensors of layers this
        model skips (V3's multi-token prediction) are dropped first, so none of theirs is held or dequantized."""
        kept = ((name, t) for name, t in weights if self.map_weight_name(name) is not None)
        if getattr(self.checkpoint_quant, "fmt", None) == "nvfp4":  # an NVFP4 kv_b_proj: layers/quant/fp4_*.py
            from graphserve.layers.quant.fp4_dequant_at_load import dequantize_fp4_at_load

            return super().load_weights(dequantize_fp4_at_load(kept, self.dequantized_at_load))
        return super().load_weights(dequantize_at_load(kept, self.dequantized_at_load, self.checkpoint_quant))

    @classmethod
    def describe(cls, config: Any, dtype: torch.dtype, tp: int = 1, ep: int = 1) -> ModelDescription:
        """Per rank: ``num_attention_heads / tp`` heads, the whole latent cache (one 576-wide head for
        V2/V3 at every tp), dense and shared MLPs split by ``tp``, routed experts split by ``tp`` or
        placed by ``ep``. A split that does not divide is refused naming the field."""
        s = cls.config_shape(config)
        h, r, d, nope, v = s.hidden_size, s.kv_lora_rank, s.qk_rope_head_dim, s.qk_nope_head_dim, s.v_head_dim
        heads = split_evenly(s.num_heads, tp, "num_attention_heads")  # this rank's
        n_moe = len(s.moe_layers)
        n_dense = s.num_layers - n_moe
        inter = split_evenly(s.intermediate_size, tp, "intermediate_size") if n_dense else 0
        local_experts = split_evenly(s.n_routed_experts, ep, "n_routed_experts") if n_moe else 0
        # --ep places whole experts; --tp splits each along its intermediate size (as it does the shared ones)
        expert_inter = 0 if not n_moe else s.moe_intermediate_size if ep > 1 else \
            split_evenly(s.moe_intermediate_size, tp, "moe_intermediate_size")
        shared_total = s.moe_intermediate_size * s.n_shared_experts if n_moe else 0
        shared_inter = split_evenly(shared_total, tp, "moe_intermediate_size * n_shared_experts") if shared_total \
            else 0
        qk, bias = nope + d, s.attention_bias
        # q_proj's rows of this rank's heads, or the whole q_a_proj (+ norm) and its heads' rows of q_b_proj
        if s.q_lora_rank is None:
            q_params = h * heads * qk
        else:
            q_params = h * s.q_lora_rank + bias * s.q_lora_rank + s.q_lora_rank + s.q_lora_rank * heads * qk
        # kv_a_proj_with_mqa and its norm whole on every rank; kv_b_proj and o_proj for this rank's heads
        # (o_proj's bias is held on every rank, zeros past rank 0)
        attn = q_params + h * (r + d) + bias * (r + d) + r + r * heads * (nope + v) + heads * v * h + bias * h
        mlp_bias = s.mlp_bias
        dense_bias, shared_bias = mlp_bias * (2 * inter + h), mlp_bias * (2 * shared_inter + h) if shared_inter else 0
        dense_mlp = 3 * h * inter + dense_bias
        shared = 3 * h * shared_inter + shared_bias if shared_inter else 0
        # every MoE layer reads its gate, its correction bias (V3) and its shared experts whatever the routing
        router = s.n_routed_experts * h + (s.n_routed_experts if s.scoring_func == "sigmoid" else 0)
        moe_fixed = router + shared
        dense_params = s.num_layers * (attn + 2 * h) + n_dense * dense_mlp + n_moe * moe_fixed + h
        # kept in the model dtype under FP8: norms (the layers', q-a's, kv-a's, the final), routers, kv_b_proj and
        # the biases (attention's, the dense and shared MLPs')
        norms = s.num_layers * (2 * h + r + (s.q_lora_rank or 0)) + h
        biases = s.num_layers * bias * ((s.q_lora_rank or 0) + (r + d) + h) + n_dense * dense_bias + n_moe * shared_bias
        model_dtype = norms + n_moe * router + biases + s.num_layers * r * heads * (nope + v)
        # a token at the attention peak: q, the kv-a output, q and output in latent space, the output heads
        attn_act = heads * qk + (r + d) + 2 * heads * r + heads * v
        moe_act = s.n_routed_experts + s.top_k * (3 * expert_inter + h) + 3 * shared_inter if n_moe else 0
        # what FP8 quantizes: q_proj or q_a_proj fused with kv_a_proj_with_mqa, q_b_proj, o_proj, the MLPs
        q_rows = heads * qk if s.q_lora_rank is None else s.q_lora_rank
        layers, dense = range(s.num_layers), [i for i in range(s.num_layers) if i not in s.moe_layers]
        projections = (Projection(q_rows + r + d, h, 2, layer_modules(layers, "self_attn.fused_qkv_a_proj")),
                       Projection(h, heads * v, 1, layer_modules(layers, "self_attn.o_proj")),
                       *([Projection(heads * qk, s.q_lora_rank, 1, layer_modules(layers, "self_attn.q_b_proj"))]
                         if s.q_lora_rank else []),
                       *mlp_projections(h, inter, dense), *mlp_projections(h, shared_inter, s.moe_layers,
                                                                           "mlp.shared_experts"))
        vocab_rows = -(-s.vocab_size // tp)
        return ModelDescription(
            kv=KVLayout("latent", s.num_layers, 1, r + d, dtype), hidden_size=h, vocab_size=s.vocab_size,
            weight_bytes_per_param=dtype.itemsize, dense_params=dense_params, embed_params=vocab_rows * h,
            lm_head_params=0 if s.tie_word_embeddings else vocab_rows * h,
            expert_params=3 * h * expert_inter, local_experts=local_experts,
            num_experts=s.n_routed_experts if n_moe else 0, top_k=s.top_k if n_moe else 0, num_moe_layers=n_moe,
            act_width=max(attn_act, 3 * inter, moe_act), act_bytes_per_elem=dtype.itemsize,
            model_dtype_params=model_dtype, projections=projections,
            expert_layers=layer_modules(s.moe_layers, "mlp.experts"),
        )


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1: q LoRA, sigmoid routing with ``e_score_correction_bias`` over expert groups."""

    version = 3

