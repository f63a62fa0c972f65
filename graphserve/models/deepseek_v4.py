"""DeepSeek-V4 (``DeepseekV4ForCausalLM``), as transformers' ``models/deepseek_v4`` specifies it.

- attention (models/deepseek_v4_attention.py): one shared K=V latent head, partial interleaved rope, q LoRA, sinks, a
  sliding window beside compressed entries per ``layer_types`` (CSA with its lightning indexer, HCA), a grouped
  low-rank output projection;
- hyper-connections (layers/hyper_connection.py): ``hc_mult`` residual streams, Sinkhorn-mixed around each sublayer;
- MoE on every layer: ``sqrtsoftplus`` scores, the top-k chosen with ``e_score_correction_bias`` (``moe``) or read
  from the frozen ``tid2eid[token]`` table (``hash_moe``), renormalised and scaled by ``routed_scaling_factor``; one
  shared expert; experts and shared expert clamp gate and up at ``swiglu_limit`` (FusedMoE ``silu_clamp``).

Cache (layers/kv_layout.py): per layer a latent per token (the window reads the last ``sliding_window``), and per
compressed layer one compact page a block (layers/kv_layout.CompactCache): the compressor checkpoint (fp32
accumulators of the open groups) and one row per ``rate`` tokens holding the group's compressed entry and (CSA)
indexer key (kernels/v4_reference.py). The MTP layers (``num_nextn_predict_layers``) are
not loaded: nothing runs them until speculative decoding exists, and start-up says so. Checkpoints load in
DeepSeek's own names or transformers' (models/deepseek_v4_names.py).

On the GPU the attention runs on its Triton kernels (kernels/v4_compress.py, kernels/v4_attention.py, the DSA
indexer and top-k) and the experts, the clamped SwiGLU included, on the fused MoE kernels (bf16/FP8:
kernels/moe_fused.py; FP4: kernels/fp4_moe.py); decode captures in CUDA graphs. ``--tp``/``--ep`` are refused at
load; ``describe`` prices them (transformers' plan: attention replicated, experts split) for ``graphserve plan``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from graphserve.distributed.state import get_parallel, split_evenly
from graphserve.errors import ModelLoadError
from graphserve.layers.embedding import VocabEmbedding
from graphserve.layers.hyper_connection import HyperConnection, HyperHead
from graphserve.layers.kv_layout import CompactCache, KVLayout
from graphserve.layers.linear import Linear
from graphserve.layers.moe import FusedMoE, Router
from graphserve.layers.norm import RMSNorm
from graphserve.models.base import CausalLM
from graphserve.models.deepseek_v4_attention import V4Attention
from graphserve.models.deepseek_v4_names import module_name
from graphserve.models.deepseek_v4_shape import CSA, V4Shape, v4_shape_from_config
from graphserve.models.description import ModelDescription, Projection, layer_modules

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w3|w2)\.weight$")
_STACK = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_BUFFERS = (".mlp.gate.e_score_correction_bias", ".mlp.gate.tid2eid")
class SqrtSoftplusTopK(Router):
    """``sqrt(softplus(logit))`` scores; the top-k by score + ``e_score_correction_bias`` (the choice only); the
    chosen scores renormalised and times ``routed_scaling_factor``. With ``table`` (hash_moe) the experts are
    ``table[token]`` instead."""

    scoring_func = "sqrtsoftplus"

    def __init__(self, num_experts: int, top_k: int, scaling: float) -> None:
        super().__init__(num_experts, top_k)
        self.scaling = scaling
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, logits: torch.Tensor, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softplus(logits.float()).sqrt()
        if ids is None:
            ids = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids.long())
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        return weights, ids.to(torch.int32)


class V4Gate(Linear):
    """``mlp.gate``: the router projection, with the hash layers' ``tid2eid [vocab, top_k]`` table."""

    def __init__(self, s: V4Shape, hashed: bool) -> None:
        super().__init__(s.hidden_size, s.num_experts, bias=False)
        self.hashed, self.top_k, self.num_experts = hashed, s.top_k, s.num_experts
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(s.vocab_size, s.top_k, dtype=torch.int64))

    def rebuild(self, device: torch.device) -> None:
        """A dummy model's table: distinct experts per token, spread evenly (a checkpoint's overwrites it)."""
        if self.hashed:
            tokens = torch.arange(self.tid2eid.shape[0], device=device)[:, None]
            self.tid2eid = (tokens * 7 + torch.arange(self.top_k, device=device)) % self.num_experts


class V4SharedExpert(nn.Module):
    def __init__(self, s: V4Shape) -> None:
        super().__init__()
        self.limit = s.swiglu_limit
        self.gate_proj = Linear(s.hidden_size, s.moe_intermediate_size, bias=False)
        self.up_proj = Linear(s.hidden_size, s.moe_intermediate_size, bias=False)
        self.down_proj = Linear(s.moe_intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        return self.down_proj(F.silu(gate) * self.up_proj(x).clamp(-self.limit, self.limit))


class V4MoE(nn.Module):
    def __init__(self, s: V4Shape, layer: int) -> None:
        super().__init__()
        self.gate = V4Gate(s, s.mlp_layer_types[layer] == "hash_moe")
        router = SqrtSoftplusTopK(s.num_experts, s.top_k, s.routed_scaling_factor)
        self.experts = FusedMoE(s.num_experts, s.top_k, s.hidden_size, s.moe_intermediate_size, router,
                                activation="silu_clamp", swiglu_limit=s.swiglu_limit)  # fmt: skip
        self.shared_experts = V4SharedExpert(s)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        logits = self.gate(x)
        if self.gate.hashed and self.experts.routing_override is None:
            weights, ids = self.experts.router(logits, self.gate.tid2eid[input_ids])
        else:
            weights, ids = self.experts.route(logits)
        return self.experts._experts(x, weights, ids, batch.num_valid_tokens) + self.shared_experts(x)


class V4DecoderLayer(nn.Module):
    def __init__(self, s: V4Shape, layer: int, cache_index: int | None) -> None:
        super().__init__()
        self.self_attn = V4Attention(s, layer, cache_index)
        self.mlp = V4MoE(s, layer)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        hc = (s.hc_mult, s.hidden_size, s.hc_sinkhorn_iters, s.hc_eps, s.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)

    def forward(self, positions: torch.Tensor, streams: torch.Tensor, input_ids: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:  # fmt: skip
        post, comb, x = self.attn_hc(streams)
        out = self.self_attn(positions, self.input_layernorm(x), batch)
        streams = HyperConnection.merge(streams, out, post, comb)
        post, comb, x = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(x), input_ids, batch)
        return HyperConnection.merge(streams, out, post, comb)


class V4Model(nn.Module):
    def __init__(self, s: V4Shape) -> None:
        super().__init__()
        self.hc = s.hc_mult
        self.embed_tokens = VocabEmbedding(s.vocab_size, s.hidden_size, 0, 1)
        # compressed layers' compact pages follow the latents in the pool's list (KVLayout.compact)
        rows = {layer: s.num_layers + i for i, layer in enumerate(s.compressed_layers)}
        self.layers = nn.ModuleList(V4DecoderLayer(s, i, rows.get(i)) for i in range(s.num_layers))
        self.hc_head = HyperHead(s.hc_mult, s.hidden_size, s.hc_eps, s.rms_norm_eps)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc, -1).contiguous()
        for layer in self.layers:
            streams = layer(positions, streams, input_ids, batch)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(CausalLM):
    builds_windows = True  # every layer attends in its sliding window beside the compressed entries

    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        ps = get_parallel()
        if ps.tp_size > 1 or ps.ep_size > 1:
            raise ModelLoadError(f"DeepseekV4ForCausalLM runs at --tp 1 --ep 1 so far (got --tp {ps.tp_size} --ep "
                                 f"{ps.ep_size}); graphserve plan prices larger ones", param="tp")  # fmt: skip
        self.config = config
        self.shape = s = v4_shape_from_config(config)
        self.model = V4Model(s)
        self.add_lm_head(s.hidden_size, s.vocab_size, s.tie_word_embeddings)
        if s.num_nextn_predict_layers:
            logger.info("DeepseekV4: %d MTP layer(s) in the checkpoint are not loaded: nothing runs them until "
                        "speculative decoding exists", s.num_nextn_predict_layers)  # fmt: skip

    def needs_row_mask(self) -> bool:
        return True

    # ---- loading ---------------------------------------------------------------------------------
    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        if name.startswith(("mtp.", "model.mtp.")):
            return None
        name = module_name(name)
        hit = _EXPERT.search(name)
        if hit is not None:
            param = "w2_weight" if hit.group(2) == "w2" else "w13_weight"
            return f"{name[: hit.start()]}.experts.{param}", (int(hit.group(1)), hit.group(2))
        return super().map_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split(weights))

    def _split(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Expert stacks (``gate_up_proj [E, 2I, H]``: gate rows then up rows; ``down_proj [E, H, I]``) as one
        tensor per (expert, part); the routing buffers copied in place; every other tensor as it comes."""
        s = self.shape
        for ckpt_name, tensor in weights:
            name = module_name(ckpt_name)
            if name.endswith(_BUFFERS):
                owner, _, leaf = name.rpartition(".")
                buf = getattr(self.get_submodule(owner), leaf, None) if leaf == "tid2eid" else \
                    self.get_submodule(owner.replace(".gate", ".experts.router")).e_score_correction_bias
                if buf is None or buf.shape != tensor.shape:
                    raise ModelLoadError(f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)} does not fit "
                                         f"{type(self).__name__}'s layer types", param="model")  # fmt: skip
                if leaf == "tid2eid" and (tensor.min() < 0 or tensor.max() >= s.num_experts):
                    raise ModelLoadError(f"checkpoint tensor {name!r} names experts outside 0..{s.num_experts - 1}",
                                         param="model")  # fmt: skip
                buf.copy_(tensor)
                continue
            hit = _STACK.search(name)
            if hit is None:
                yield ckpt_name, tensor
                continue
            prefix, i = name[: hit.start()] + ".mlp.experts", s.moe_intermediate_size
            gate_up = hit.group(1) == "gate_up_proj"
            expected = (s.num_experts, 2 * i, s.hidden_size) if gate_up else (s.num_experts, s.hidden_size, i)
            if tuple(tensor.shape) != expected:
                raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the config's "
                                     f"{expected}", param="model")  # fmt: skip
            for e in range(s.num_experts):
                if gate_up:
                    yield f"{prefix}.{e}.w1.weight", tensor[e, :i]
                    yield f"{prefix}.{e}.w3.weight", tensor[e, i:]
                else:
                    yield f"{prefix}.{e}.w2.weight", tensor[e]

    # ---- what the engine reads -------------------------------------------------------------------
    @classmethod
    def describe(cls, config: Any, dtype: torch.dtype, tp: int = 1, ep: int = 1) -> ModelDescription:
        """Per rank under transformers' plan for V4 (attention, shared experts and routers on every rank; routed
        experts split by ``--ep``, or their intermediate size by ``--tp``)."""
        s = v4_shape_from_config(config)
        h, n, d, di, q = s.hidden_size, s.num_layers, s.head_dim, s.index_head_dim, s.q_lora_rank
        inter = s.moe_intermediate_size if ep > 1 else split_evenly(s.moe_intermediate_size, tp, "moe_intermediate_size")
        layers = range(n)
        proj: list[tuple[int, int, Iterable[int], str]] = [
            (q, h, layers, "self_attn.q_a_proj"), (s.num_heads * d, q, layers, "self_attn.q_b_proj"),
            (d, h, layers, "self_attn.kv_proj"),
            (s.o_groups * s.o_lora_rank, s.num_heads * d // s.o_groups, layers, "self_attn.o_a_proj"),
            (h, s.o_groups * s.o_lora_rank, layers, "self_attn.o_b_proj"),
            (s.moe_intermediate_size, h, layers, "mlp.shared_experts.gate_proj"),
            (s.moe_intermediate_size, h, layers, "mlp.shared_experts.up_proj"),
            (h, s.moe_intermediate_size, layers, "mlp.shared_experts.down_proj"),
        ]  # fmt: skip
        csa = [i for i in layers if s.layer_types[i] == CSA]
        hca = [i for i in s.compressed_layers if i not in csa]
        for part in ("kv_proj", "gate_proj"):
            proj += [(2 * d, h, csa, f"self_attn.compressor.{part}"), (d, h, hca, f"self_attn.compressor.{part}"),
                     (2 * di, h, csa, f"self_attn.compressor.indexer.{part}")]  # fmt: skip
        proj += [(s.index_n_heads * di, q, csa, "self_attn.compressor.indexer.q_b_proj"),
                 (s.index_n_heads, h, csa, "self_attn.compressor.indexer.scorer.weights_proj")]  # fmt: skip
        projections = tuple(Projection(o, i, 1, layer_modules(ls, m)) for o, i, ls, m in proj if ls)
        hc_mix = (2 + s.hc_mult) * s.hc_mult
        # float32 whatever the model dtype, as transformers keeps them: sinks, hyper-connections, position biases
        biases = sum(s.rate(i) * ((2 * d + 2 * di) if i in csa else d) for i in s.compressed_layers)
        float32 = n * (s.num_heads + 2 * (hc_mix * s.hc_mult * h + hc_mix + 3)) + biases + \
            s.hc_mult * s.hc_mult * h + s.hc_mult + 1  # fmt: skip
        # the rest of the non-projections: norms (the compressors' too) and the router gates
        kept = float32 + n * (2 * h + q + d + s.num_experts * h) + h + len(s.compressed_layers) * d + len(csa) * di
        listed = sum(p.params for p in projections)
        b = dtype.itemsize
        compact = tuple(CompactCache(s.rate(i), s.entry_width(i), 4 * s.state_floats(i)) for i in s.compressed_layers)
        kv = KVLayout(kind="latent", num_layers=n, num_heads=1, head_dim=d, dtype=dtype, compact=compact,
                      row_dtype=dtype)  # fmt: skip
        act = max(s.num_heads * d * 2 + q, s.num_experts + s.top_k * 3 * inter + 2 * s.moe_intermediate_size,
                  s.hc_mult * h * 2)  # fmt: skip
        return ModelDescription(
            kv=kv, hidden_size=h, vocab_size=s.vocab_size, weight_bytes_per_param=b,
            dense_params=listed + kept, embed_params=s.vocab_size * h,
            lm_head_params=0 if s.tie_word_embeddings else s.vocab_size * h,
            expert_params=3 * h * inter, local_experts=split_evenly(s.num_experts, ep, "n_routed_experts"),
            num_experts=s.num_experts, top_k=s.top_k, num_moe_layers=n, act_width=act, act_bytes_per_elem=b,
            model_dtype_params=kept, float32_params=float32, projections=projections,
            expert_layers=layer_modules(layers, "mlp.experts"), kv_read_per_seq=partial(decode_kv_read, s, b),
        )  # fmt: skip


def decode_kv_read(s: V4Shape, itemsize: int, context: int) -> int:
    """The cache bytes one decode query at ``context`` tokens must read, summed over layers: its window's latents;
    HCA every compressed entry; CSA every indexer key and the ``index_topk`` entries chosen; a compressed layer also
    its compressor checkpoint (the fp32 accumulators of the open groups, one a block: the step's own projections
    never leave the step)."""
    total = state = 0
    for i, t in enumerate(s.layer_types):
        total += min(context, s.sliding_window) * s.head_dim
        m = s.rate(i)
        if not m:
            continue
        entries = context // m
        state += 4 * s.state_floats(i)
        if t == CSA:
            total += entries * s.index_head_dim + min(entries, s.index_topk) * s.head_dim
        else:
            total += entries * s.head_dim
    return total * itemsize + state
