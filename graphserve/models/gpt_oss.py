"""gpt-oss (GptOssForCausalLM): Llama-family attention with q/k/v/o biases, a learned sink logit per head and
sliding windows on alternate layers, then a routed block on every layer.

As transformers' ``models/gpt_oss`` builds it:
- attention: ``layer_types`` names each layer "sliding_attention" (``sliding_window`` keys, counting the query)
  or "full_attention"; ``self_attn.sinks [num_heads]`` join each head's softmax denominator; YaRN rope as
  ``rope_parameters`` says (layers/rotary.py);
- router: ``mlp.router`` is a projection with a bias; the top-k logits are softmaxed. That equals a softmax over
  every expert followed by the top-k renormalised (exp(l_i) / sum over the top-k of exp(l_j) either way), so the
  block routes with ``SoftmaxTopK(renormalize=True)`` and its kernels;
- experts: biases on gate/up and down, and the clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``, gate
  clamped above at ``swiglu_limit``, up to +-``swiglu_limit`` (layers/moe.FusedMoE ``activation="swiglu_oai"``).

Checkpoint names: the experts of a layer are stored stacked, ``mlp.experts.gate_up_proj [E, H, 2I]`` (x @ it,
gate and up columns interleaved: gate 0, up 0, gate 1, ...), ``gate_up_proj_bias [E, 2I]`` (interleaved alike),
``down_proj [E, I, H]`` and ``down_proj_bias [E, H]``. The loader splits them per expert, transposes to the
[out, in] rows FusedMoE keeps and de-interleaves gate/up into [gate rows; up rows], so the kernels see the layout
of every other MoE family. OpenAI's checkpoints store the expert matrices in MXFP4 instead (config.json
``quantization_config.quant_method: "mxfp4"``): ``gate_up_proj_blocks [E, 2I, H/32, 16]`` / ``gate_up_proj_scales
[E, 2I, H/32]`` (rows interleaved alike) and ``down_proj_blocks`` / ``down_proj_scales``, which the FP4 experts'
method (layers/quant/fp4_moe.Fp4MoEMethod.load_gpt_oss) takes whole; the biases stay in the model dtype.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphserve.distributed.comm import all_reduce
from graphserve.distributed.state import get_parallel, split_evenly
from graphserve.errors import ModelLoadError
from graphserve.layers.attention import Attention
from graphserve.layers.linear import Linear
from graphserve.layers.moe import FusedMoE, SoftmaxTopK, expert_split
from graphserve.layers.norm import RMSNorm
from graphserve.layers.rotary import RotaryEmbedding
from graphserve.models.base import CausalLM
from graphserve.models.description import ModelDescription, layer_modules
from graphserve.models.llama import (
    _STACKED,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    Shape,
    attention_kept_params,
    attention_params,
    attention_projections,
    kv_layout_of,
    layer_windows_of,
)
from graphserve.models.moe import MoEDecoderLayer, MoEShape, prefetch_next_qkv

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch

SWIGLU_ALPHA = 1.702  # transformers GptOssExperts.alpha: not in the config
DEFAULT_SWIGLU_LIMIT = 7.0  # GptOssExperts.limit, config.json's swiglu_limit where the config carries it

# one expert's tensor, as the loader hands it on after splitting the stacks (see _split_experts)
_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w3|w2)\.(weight|bias)$")
_STACK = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_MXFP4_STACK = re.compile(r"\.mlp\.experts\.((gate_up_proj|down_proj)_(blocks|scales))$")


class GptOssAttention(LlamaAttention):
    """Llama attention whose layer carries its sink logits (``self_attn.sinks`` in the checkpoint)."""

    def __init__(self, s: Shape, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(s, layer_idx, rotary)
        ps = get_parallel()
        self.attn = Attention(layer_idx, self.num_heads, self.scale, window=self.attn.window, sinks=True,
                              tp_rank=ps.tp_rank, tp_size=ps.tp_size)  # fmt: skip


class GptOssMoeBlock(nn.Module):
    """Router (with bias) and the routed experts; under --tp/--ep every rank routes every token and one
    all-reduce combines the ranks' partial sums (models/moe.SparseMoeBlock's scheme)."""

    def __init__(self, s: Shape, m: MoEShape, swiglu_limit: float) -> None:
        super().__init__()
        self.router = Linear(s.hidden_size, m.num_experts, bias=True)
        self.experts = FusedMoE(m.num_experts, m.top_k, s.hidden_size, m.moe_intermediate_size,
                                SoftmaxTopK(m.num_experts, m.top_k, renormalize=True), activation="swiglu_oai",
                                bias=True, swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=swiglu_limit,
                                **expert_split())  # fmt: skip

    def forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, _, residual = self.experts.forward_add_norm_gate(x, residual, norm, self.router,
                                                              valid=batch.num_valid_tokens)  # fmt: skip
        return all_reduce(out, over="experts"), residual


class GptOssDecoderLayer(MoEDecoderLayer):
    """MoEDecoderLayer's forward over gpt-oss's attention (windows, sinks) and routed block (biased router,
    clamped SwiGLU)."""

    def __init__(self, s: Shape, m: MoEShape, layer_idx: int, rotary: RotaryEmbedding, swiglu_limit: float) -> None:
        nn.Module.__init__(self)
        self.self_attn = GptOssAttention(s, layer_idx, rotary)
        self.mlp = GptOssMoeBlock(s, m, swiglu_limit)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)


def swiglu_limit_of(config: Any) -> float:
    limit = getattr(config, "swiglu_limit", None)
    limit = DEFAULT_SWIGLU_LIMIT if limit is None else float(limit)
    if not limit > 0:
        raise ModelLoadError(f"swiglu_limit={limit} must be positive", param="model")
    return limit


class GptOssForCausalLM(CausalLM):
    stacked_params = _STACKED
    builds_windows = True  # the loader lets --max-model-len exceed sliding_window: the layers attend in windows

    @classmethod
    def shape_from_config(cls, config: Any) -> Shape:
        bias = bool(getattr(config, "attention_bias", True))
        return LlamaForCausalLM._shape(config, qkv_bias=bias, o_bias=bias,
                                       windows=layer_windows_of(config, by_layer_types=True))  # fmt: skip

    @classmethod
    def moe_shape_from_config(cls, config: Any) -> MoEShape:
        experts = int(getattr(config, "num_local_experts", 0) or 0)
        top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        if experts < 1 or not 1 <= top_k <= experts:
            raise ModelLoadError(f"num_experts_per_tok={top_k} must be in [1, num_local_experts={experts}]",
                                 param="model")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":  # gpt-oss's experts hard-code their clamped SwiGLU; the field is informational there
            raise ModelLoadError(f"hidden_act={act!r}: gpt-oss's experts take 'silu' (their clamped SwiGLU)",
                                 param="model")
        return MoEShape(experts, top_k, int(config.intermediate_size), True, frozenset(range(config.num_hidden_layers)))

    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        self.config = config
        s, m = self.shape_from_config(config), self.moe_shape_from_config(config)
        self.shape, self.moe_shape = s, m
        limit = swiglu_limit_of(config)
        self.model = LlamaModel(s, max_positions, lambda i, rotary: GptOssDecoderLayer(s, m, i, rotary, limit))
        prefetch_next_qkv(self.model.layers)
        self.add_lm_head(s.hidden_size, s.vocab_size, s.tie_word_embeddings)

    def needs_row_mask(self) -> bool:
        return True

    # ---- loading ---------------------------------------------------------------------------------
    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        hit = _EXPERT.search(name)
        if hit is not None:
            expert, part, kind = int(hit.group(1)), hit.group(2), hit.group(3)
            stacked = "w2_" if part == "w2" else "w13_"
            return f"{name[: hit.start()]}.experts.{stacked}{kind}", (expert, part)
        if name.endswith(".self_attn.sinks"):
            return name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
        return super().map_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        whole: set[str] = set()  # the keys of the MXFP4 stacks, loaded here whole
        loaded = super().load_weights(self._split_experts(self._mxfp4_stacks(weights, whole)))
        return loaded | whole

    def _mxfp4_stacks(self, weights: Iterable[tuple[str, torch.Tensor]], whole: set[str]
                      ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
        """Hands each MXFP4 expert stack to its layer's FP4 method, adding the (expert, part) keys it fills to
        ``whole``; every other tensor passes on."""
        for name, tensor in weights:
            hit = _MXFP4_STACK.search(name)
            if hit is None:
                yield name, tensor
                continue
            module = name[: hit.start()] + ".mlp.experts"
            layer = self.get_submodule(module)
            load = getattr(layer.quant_method, "load_gpt_oss", None)
            if load is None:
                raise ModelLoadError(f"checkpoint tensor {name!r} holds MXFP4 experts, but {module} is not FP4: the "
                                     "checkpoint's config.json needs quantization_config.quant_method 'mxfp4'",
                                     param="model")  # fmt: skip
            try:
                filled = load(layer, hit.group(1), tensor)
            except ValueError as e:
                raise ModelLoadError(f"checkpoint tensor {name!r} does not fit {module}: {e}", param="model") from e
            whole.update(f"{module}.{key}" for key in filled)

    def _split_experts(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The stacked expert tensors as one tensor per (expert, part), in FusedMoE's [out, in] rows with gate/up
        de-interleaved; every other tensor as it comes."""
        m, h = self.moe_shape, self.shape.hidden_size
        e, i = m.num_experts, m.moe_intermediate_size
        for name, tensor in weights:
            hit = _STACK.search(name)
            if hit is None:
                yield name, tensor
                continue
            stack, bias = hit.group(1), hit.group(2) is not None
            prefix = name[: hit.start()] + ".mlp.experts"
            if stack == "gate_up_proj":
                expected = (e, 2 * i) if bias else (e, h, 2 * i)
            else:
                expected = (e, h) if bias else (e, i, h)
            if tuple(tensor.shape) != expected:
                raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the config's "
                                     f"{expected} (num_local_experts={e}, hidden_size={h}, intermediate_size={i})",
                                     param="model")  # fmt: skip
            kind = "bias" if bias else "weight"
            for expert in range(e):
                t = tensor[expert] if bias else tensor[expert].transpose(0, 1)  # [2I | H] or [2I, H] / [H, I]
                if stack == "gate_up_proj":
                    yield f"{prefix}.{expert}.w1.{kind}", t[0::2]
                    yield f"{prefix}.{expert}.w3.{kind}", t[1::2]
                else:
                    yield f"{prefix}.{expert}.w2.{kind}", t

    # ---- what the engine reads -------------------------------------------------------------------
    @classmethod
    def describe(cls, config: Any, dtype: torch.dtype, tp: int = 1, ep: int = 1) -> ModelDescription:
        s, m = cls.shape_from_config(config), cls.moe_shape_from_config(config)
        h, layers = s.hidden_size, s.num_layers
        attn, attn_act = attention_params(s, tp)
        moe_inter = m.moe_intermediate_size if ep > 1 else split_evenly(m.moe_intermediate_size, tp,
                                                                          "intermediate_size")
        local_experts = split_evenly(m.num_experts, ep, "num_local_experts")
        sinks = s.num_heads // tp
        router = m.num_experts * h + m.num_experts
        # kept in the model dtype under FP8: norms, attention biases and sinks (these in float32), the router
        model_dtype = layers * (2 * h + attention_kept_params(s, tp) + sinks + router) + h
        return ModelDescription(
            kv=kv_layout_of(s, dtype, tp), hidden_size=h, vocab_size=s.vocab_size,
            weight_bytes_per_param=dtype.itemsize,
            dense_params=layers * (attn + sinks + 2 * h + router) + h,
            embed_params=-(-s.vocab_size // tp) * h,
            lm_head_params=0 if s.tie_word_embeddings else -(-s.vocab_size // tp) * h,
            # an expert's biases (gate/up [2I], down [H]) are read with it, in the model dtype whatever its matrices
            expert_params=3 * h * moe_inter, expert_bias_params=2 * moe_inter + h, local_experts=local_experts, num_experts=m.num_experts, top_k=m.top_k,
            num_moe_layers=layers, act_width=max(attn_act, m.num_experts + m.top_k * (3 * moe_inter + h)),
            act_bytes_per_elem=dtype.itemsize, model_dtype_params=model_dtype, float32_params=layers * sinks,
            projections=tuple(attention_projections(s, tp, range(layers))),
            expert_layers=layer_modules(range(layers), "mlp.experts"),
        )  # fmt: skip
