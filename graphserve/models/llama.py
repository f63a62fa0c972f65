"""The Llama family: Llama 2/3, Qwen2/2.5, Qwen3 and Mistral share one decoder.

They differ only in flags read from the Hugging Face config: q/k/v (and o) bias, per-head
q/k RMSNorm (Qwen3), tied embeddings, head_dim, rope parameters and sliding window.
Parameter names follow the checkpoint's, except the fused ``qkv_proj`` and ``gate_up_proj``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphserve.distributed.comm import all_reduce
from graphserve.distributed.state import get_parallel, split_evenly
from graphserve.errors import ModelLoadError
from graphserve.kernels.pdl import pdl_joined
from graphserve.layers.attention import Attention
from graphserve.layers.embedding import VocabEmbedding
from graphserve.layers.kv_layout import KVLayout
from graphserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    norm_linear,
    norm_mlp,
    quantized_input_linear,
    silu_mul_linear,
)
from graphserve.layers.norm import RMSNorm
from graphserve.layers.rotary import RotaryEmbedding
from graphserve.models.base import CausalLM, DecoderStack
from graphserve.models.description import ModelDescription, Projection, layer_modules

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch

# checkpoint name fragment -> (fused parameter fragment, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


@dataclass(frozen=True)
class Shape:
    """What one architecture variant needs from its config."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    # OLMoE: q/k RMSNorm over the whole projection (not per head), and q/k/v clamped to +-clip_qkv
    qk_norm_full: bool = False
    clip_qkv: float | None = None
    # each layer's attention window (None: full causal), as transformers builds the layer; empty: all full
    layer_windows: tuple[int | None, ...] = ()


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: Any) -> int | None:
    """The attention window the checkpoint was trained with, or None when attention is global."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is not None and layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def layer_windows_of(config: Any, by_layer_types: bool) -> tuple[int | None, ...]:
    """Each layer's attention window as transformers builds the layer (empty: none windowed). Mistral
    (``by_layer_types`` False) windows every layer with ``sliding_window``; Qwen2 and Qwen3 window the layers that
    ``layer_types`` names "sliding_attention", with ``sliding_window``, which their configs set to None unless
    ``use_sliding_window`` (their default ``layer_types`` windows the layers from ``max_window_layers`` on)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"sliding_window={window!r} must be an integer >= 1", param="model")
    if not by_layer_types:
        return (window,) * config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers:
        raise ModelLoadError(f"layer_types has {len(types)} entries, num_hidden_layers={config.num_hidden_layers}",
                             param="model")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ModelLoadError(f"layer_types holds {unknown}: only 'sliding_attention' and 'full_attention' are built",
                             param="model")
    return tuple(window if t == "sliding_attention" else None for t in types)


def binding_windows(windows: tuple[int | None, ...], max_len: int) -> tuple[int | None, ...]:
    """``windows`` with those that never bind over ``max_len`` positions (window >= max_len) set to None; empty
    where none binds."""
    kept = tuple(w if w is not None and w < max_len else None for w in windows)
    return kept if any(w is not None for w in kept) else ()


def local_kv_heads(s: Shape, tp: int) -> int:
    """KV heads on one rank: split across ranks; with fewer KV heads than ranks each rank keeps a replica."""
    split_evenly(s.num_heads, tp, "num_attention_heads")
    if s.num_kv_heads >= tp:
        return split_evenly(s.num_kv_heads, tp, "num_key_value_heads")
    if tp % s.num_kv_heads:
        raise ValueError(f"num_key_value_heads={s.num_kv_heads} cannot be replicated evenly over {tp} ranks")
    return 1


def kv_layout_of(s: Shape, dtype: torch.dtype, tp: int = 1) -> KVLayout:
    return KVLayout("kv", s.num_layers, local_kv_heads(s, tp), s.head_dim, dtype, s.layer_windows)


def attention_params(s: Shape, tp: int) -> tuple[int, int]:
    """(parameters of one attention block on a rank, activation elements one token holds in it)."""
    if s.qk_norm_full and tp > 1:
        raise ValueError("q/k RMSNorm over the whole projection (OLMoE) needs every head on one rank: "
                         "num_attention_heads does not split, use --tp 1 (or --ep)")
    heads, kvh = s.num_heads // tp, local_kv_heads(s, tp)
    q, kv = heads * s.head_dim, kvh * s.head_dim
    params = s.hidden_size * (q + 2 * kv) + q * s.hidden_size + attention_kept_params(s, tp)
    return params, (q + 2 * kv) + q


def attention_projections(s: Shape, tp: int, layers: Iterable[int]) -> list[Projection]:
    """The attention projections of ``layers`` on a rank: qkv_proj (q, k, v fused) and o_proj."""
    q, kv = s.num_heads // tp * s.head_dim, local_kv_heads(s, tp) * s.head_dim
    return [Projection(q + 2 * kv, s.hidden_size, 3, layer_modules(layers, "self_attn.qkv_proj")),
            Projection(s.hidden_size, q, 1, layer_modules(layers, "self_attn.o_proj"))]


def mlp_projections(hidden: int, inter: int, layers: Collection[int], module: str = "mlp") -> list[Projection]:
    """The gated MLP ``module`` of ``layers`` on a rank (``inter`` its intermediate size): gate_up_proj and
    down_proj."""
    if not layers or not inter:
        return []
    return [Projection(2 * inter, hidden, 2, layer_modules(layers, f"{module}.gate_up_proj")),
            Projection(hidden, inter, 1, layer_modules(layers, f"{module}.down_proj"))]


def attention_kept_params(s: Shape, tp: int) -> int:
    """Those of one attention block's parameters on a rank that FP8 leaves in the model dtype: the projections'
    biases and the q/k norms' weights."""
    heads, kvh = s.num_heads // tp, local_kv_heads(s, tp)
    q, kv = heads * s.head_dim, kvh * s.head_dim
    kept = (q + 2 * kv if s.qkv_bias else 0) + (s.hidden_size if s.o_bias else 0)
    if s.qk_norm_full:
        kept += q + kv
    elif s.qk_norm:
        kept += 2 * s.head_dim
    return kept


# The output projection's kernel at small batch (the FP8 streaming matmul, left out of PDL by default)
AFTER_DECODE_ATTENTION = frozenset({"_fp8_gemv_kernel"})


class LlamaAttention(nn.Module):
    """Attention over this rank's heads (all of them at tp 1). ``o_proj``'s output is this rank's
    partial sum: the caller all-reduces it."""

    def __init__(self, s: Shape, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        tp_rank, tp = get_parallel().tp_rank, get_parallel().tp_size
        window = s.layer_windows[layer_idx] if s.layer_windows else None
        self.layer_idx = layer_idx
        self.qkv_proj = QKVParallelLinear(s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads, s.qkv_bias,
                                          tp_rank, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_local_heads, self.qkv_proj.num_local_kv_heads
        self.head_dim = s.head_dim
        self.scale = s.head_dim**-0.5
        q_size, kv_size = self.num_heads * s.head_dim, self.num_kv_heads * s.head_dim
        self.o_proj = RowParallelLinear(s.num_heads * s.head_dim, s.hidden_size, s.o_bias, tp_rank, tp)
        attention_params(s, tp)  # refuses a split this attention cannot take
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps) if s.qk_norm else None
        # the fused prologue kernel normalises per head; a whole-projection norm or a clamp runs unfused
        self.full_norm = s.qk_norm_full
        self.clip_qkv = s.clip_qkv
        if s.qk_norm_full:
            self.q_norm, self.k_norm = RMSNorm(q_size, s.rms_norm_eps), RMSNorm(kv_size, s.rms_norm_eps)
        self.rotary = [rotary]  # a list, so the shared module is not registered once per layer
        self.attn = Attention(layer_idx, self.num_heads, self.scale, window=window, tp_rank=tp_rank, tp_size=tp)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.forward_qkv(positions, self.qkv_proj(hidden), batch)

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention from the q/k/v projection's output (the decoder layer fuses its norm into that projection).
        Where the attention kernel leaves room beside its programs (a decode step at small batch), the output
        projection launches with PDL (kernels/pdl.pdl_joined): its programs are placed while attention runs."""
        room = self.attn.leaves_room(batch)
        with pdl_joined(AFTER_DECODE_ATTENTION) if room else contextlib.nullcontext():
            return self._attention(positions, qkv, batch)

    def _attention(self, positions: torch.Tensor, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = qkv.shape[0]
        if batch.attn_backend.fused_prologue and not self.full_norm and self.clip_qkv is None:
            new = self.new_token(qkv, positions, batch)
            backend = batch.attn_backend
            if backend.quantizes_output(batch):
                # an FP8 o_proj that quantizes its input reads it from the attention kernel, already quantized
                projected = quantized_input_linear(
                    self.o_proj, t, qkv.dtype, qkv.device,
                    lambda **layout: self.attn.attend_quantized(new, batch, **layout),
                )  # fmt: skip
                if projected is not None:
                    return projected
            out = self.attn.attend(new, batch)
        else:
            q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
            if self.full_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.clip_qkv is not None:
                q, k, v = (x.clamp(-self.clip_qkv, self.clip_qkv) for x in (q, k, v))
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and not self.full_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary[0](positions, q, k)
            out = self.attn(q, k, v, batch)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def new_token(self, qkv: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch):
        """What a backend with ``fused_prologue`` needs to norm and rotate q/k and write K/V itself
        (kernels/decode_attention.NewToken): in a decode step inside its attention kernel, else in one
        launch before it (kernels/qk_rope_kv.py). Unfused, that work is four launches a layer (two norms,
        rotary, KV write), which at small batch take longer than the work itself."""
        from graphserve.kernels.decode_attention import NewToken  # Triton, only for backends that fuse

        cos_sin = self.rotary[0].cos_sin_cache  # [max_positions, D]: cos of the D/2 angles, then their sin
        half = cos_sin.shape[1] // 2
        norms = {}
        if self.q_norm is not None:
            norms = {"q_norm_weight": self.q_norm.weight, "k_norm_weight": self.k_norm.weight, "eps": self.q_norm.eps}
        return NewToken(qkv, self.num_heads, positions, cos_sin[:, :half], cos_sin[:, half:], batch.slot_mapping,
                        **norms)  # fmt: skip


class LlamaMLP(nn.Module):
    """The MLP over this rank's slice of the intermediate size; the caller all-reduces its output."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        tp_rank, tp = get_parallel().tp_rank, get_parallel().tp_size
        self.gate_up_proj = MergedColumnParallelLinear(s.hidden_size, [s.intermediate_size] * 2, s.mlp_bias, tp_rank, tp)
        self.down_proj = RowParallelLinear(s.intermediate_size, s.hidden_size, s.mlp_bias, tp_rank, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_gate_up(self.gate_up_proj(x))

    def forward_gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP from the gate/up projection's output."""
        return silu_mul_linear(gate_up, self.down_proj)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, s: Shape, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(s, layer_idx, rotary)
        self.mlp = LlamaMLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # each norm is taken together with the projection it feeds: at decode batch sizes on CUDA
        # both run in one gemv launch (layers/linear.py norm_linear). Under tensor parallelism the
        # attention and MLP outputs are partial sums: one all-reduce each (no-ops at tp 1).
        qkv, residual = norm_linear(self.input_layernorm, hidden, residual, self.self_attn.qkv_proj)
        hidden = all_reduce(self.self_attn.forward_qkv(positions, qkv, batch))
        # the post-attention norm rides in the MLP's launches (layers/linear.py norm_mlp)
        out, residual = norm_mlp(self.post_attention_layernorm, hidden, residual, self.mlp.gate_up_proj,
                                 self.mlp.down_proj)
        return all_reduce(out), residual


class LlamaModel(DecoderStack):
    """Embedding, decoder layers, final norm. ``make_layer(i, rotary)`` builds layer i (families whose
    layers differ, e.g. MoE layers between dense ones, pass their own)."""

    def __init__(self, s: Shape, max_positions: int, make_layer=None) -> None:
        super().__init__()
        ps = get_parallel()
        # a window at least as long as the longest sequence never binds: such layers attend in full
        s = dataclasses.replace(s, layer_windows=binding_windows(s.layer_windows, max_positions))
        self.embed_tokens = VocabEmbedding(s.vocab_size, s.hidden_size, ps.tp_rank, ps.tp_size)
        self.rotary_emb = RotaryEmbedding(s.head_dim, max_positions, s.rope_parameters)
        make_layer = make_layer or (lambda i, rotary: LlamaDecoderLayer(s, i, rotary))
        self.layers = nn.ModuleList(make_layer(i, self.rotary_emb) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """Llama 2/3 (attention_bias / mlp_bias flags honoured)."""

    stacked_params = _STACKED
    # whether the family attends through the windows its config declares (the loader refuses a binding window
    # otherwise)
    builds_windows = False

    @classmethod
    def shape_from_config(cls, config: Any) -> Shape:
        bias = bool(getattr(config, "attention_bias", False))
        return cls._shape(config, qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))

    @staticmethod
    def _shape(config: Any, *, qkv_bias: bool, o_bias: bool, mlp_bias: bool = False, qk_norm: bool = False,
               windows: tuple[int | None, ...] = ()) -> Shape:  # fmt: skip
        rope = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}
        return Shape(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim_of(config),
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            rope_parameters=dict(rope),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            layer_windows=windows,
        )

    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.shape = self.shape_from_config(config)
        self.model = LlamaModel(self.shape, max_positions)
        self.add_lm_head(self.shape.hidden_size, self.shape.vocab_size, self.shape.tie_word_embeddings)

    @classmethod
    def describe(cls, config: Any, dtype: torch.dtype, tp: int = 1, ep: int = 1) -> ModelDescription:
        s = cls.shape_from_config(config)
        attn, attn_act = attention_params(s, tp)
        inter = split_evenly(s.intermediate_size, tp, "intermediate_size")
        mlp = 3 * s.hidden_size * inter
        return ModelDescription(
            kv=kv_layout_of(s, dtype, tp), hidden_size=s.hidden_size, vocab_size=s.vocab_size,
            weight_bytes_per_param=dtype.itemsize,
            dense_params=s.num_layers * (attn + mlp + 2 * s.hidden_size) + s.hidden_size,
            embed_params=-(-s.vocab_size // tp) * s.hidden_size,
            lm_head_params=0 if s.tie_word_embeddings else -(-s.vocab_size // tp) * s.hidden_size,
            act_width=max(attn_act, 3 * inter), act_bytes_per_elem=dtype.itemsize,
            # norms, q/k norms and biases
            model_dtype_params=s.num_layers * (2 * s.hidden_size + attention_kept_params(s, tp)) + s.hidden_size,
            projections=(*attention_projections(s, tp, range(s.num_layers)),
                         *mlp_projections(s.hidden_size, inter, range(s.num_layers))),
        )


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2/2.5: bias on q/k/v only; sliding windows on the layers ``layer_types`` names."""

    builds_windows = True

    @classmethod
    def shape_from_config(cls, config: Any) -> Shape:
        return cls._shape(config, qkv_bias=True, o_bias=False, windows=layer_windows_of(config, by_layer_types=True))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm on q and k before rotary; head_dim set independently of hidden size."""

    @classmethod
    def shape_from_config(cls, config: Any) -> Shape:
        bias = bool(getattr(config, "attention_bias", False))
        return cls._shape(config, qkv_bias=bias, o_bias=bias, qk_norm=True,
                          windows=layer_windows_of(config, by_layer_types=True))  # fmt: skip


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama whose every layer attends through ``sliding_window`` (None in v0.2 and later)."""

    builds_windows = True

    @classmethod
    def shape_from_config(cls, config: Any) -> Shape:
        bias = bool(getattr(config, "attention_bias", False))
        return cls._shape(config, qkv_bias=bias, o_bias=bias, windows=layer_windows_of(config, by_layer_types=False))
