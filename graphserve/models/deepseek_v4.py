"""DeepSeek-V4 (``DeepseekV4ForCausalLM``), as transformers' ``models/deepseek_v4`` specifies it.

- attention (models/deepseek_v4_attention.py): one shared K=V latent head, partial interleaved rope, q LoRA, sinks, a
  sliding window beside compressed entries per ``layer_types`` (CSA with its lightning indexer, HCA), a grouped
  low-rank output projection;
- hyper-connections (layers/hyper_connection.py): ``hc_mult`` residual streams, Sinkhorn-mixed around each sublayer;
- MoE on every layer: ``sqrtsoftplus`` scores, the top-k chosen with ``e_score_correction_bias`` (``moe``) or read
  from the frozen ``tid2eid[token]`` table (``hash_moe``), renormalised and scaled by ``routed_scaling_factor``; one
  shared expert; experts and shared expert clamp gate and up at ``swiglu_limit`` (FusedMoE ``silu_clamp``).

Cache (layers/kv_layout.py): per layer a latent per token, in latent pages that only the blocks of a running
sequence's window hold (the window reads the last ``sliding_window``; ``KVLayout.latent_window``), and per
compressed layer one compact page a block (layers/kv_layout.CompactCache): the compressor checkpoint (fp32
accumulators of the open groups) and one row per ``rate`` tokens holding the group's compressed entry and (CSA)
indexer key (kernels/v4_reference.py). The MTP layers (``num_nextn_predict_layers``,
models/deepseek_v4_mtp.py) are loaded and kept, counted in the description apart from what a step reads: nothing runs
them until speculative decoding exists, and start-up says so. Checkpoints load in DeepSeek's own names or
transformers' (models/deepseek_v4_names.py).

On the GPU the attention runs on its Triton kernels (kernels/v4_compress.py, kernels/v4_attention.py, the DSA
indexer and top-k), the hyper-connections on theirs (kernels/hyper_connection.py) and the experts, the clamped
SwiGLU included, on the fused MoE kernels (bf16/FP8: kernels/moe_fused.py; FP4: kernels/fp4_moe.py); decode
captures in CUDA graphs.

``--tp N`` splits attention by whole output groups, as SGLang splits V3's MLA by heads: a rank holds its
``o_groups / N`` groups' heads of ``q_b_proj`` and the sinks, their rows of ``o_a_proj`` and columns of ``o_b_proj``;
``q_a_proj``, the one K=V latent (and its cache), the compressor and the indexer are replicated, so the attention
kernels run unchanged on every rank and every rank's indexer picks the same entries (transformers' plan splits the
indexer's heads instead, which adds an all-reduce of every query's scores over all compressed entries). The
embedding and lm_head split the vocabulary, the shared expert its intermediate size; routed experts split theirs,
or with ``--ep`` are placed whole (the hash layers' token->expert table is global, so every rank routes alike).
Hyper-connections are replicated: they read the all-reduced outputs. Two all-reduces a layer, as V3's.
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

from graphserve.distributed.comm import all_reduce
from graphserve.distributed.state import get_parallel, split_evenly
from graphserve.errors import ModelLoadError
from graphserve.kernels.v4_reference import latent_slots
from graphserve.layers.embedding import VocabEmbedding
from graphserve.layers.hyper_connection import HyperConnection, HyperHead
from graphserve.layers.kv_layout import CompactCache, KVLayout
from graphserve.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from graphserve.layers.moe import FusedMoE, Router, expert_split
from graphserve.layers.norm import RMSNorm
from graphserve.models.base import CausalLM
from graphserve.models.deepseek_v4_attention import V4Attention, use_kernels
from graphserve.models.deepseek_v4_mtp import mtp_module_name, mtp_shape
from graphserve.models.deepseek_v4_names import module_name
from graphserve.models.deepseek_v4_shape import CSA, V4Shape, v4_shape_from_config
from graphserve.models.description import ModelDescription, Projection

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
    """The always-on expert over this rank's slice of its intermediate size (whole at ``--tp 1``)."""

    def __init__(self, s: V4Shape) -> None:
        super().__init__()
        self.limit = s.swiglu_limit
        tp_rank, tp = get_parallel().tp_rank, get_parallel().tp_size
        h, i = s.hidden_size, s.moe_intermediate_size
        self.gate_proj = ColumnParallelLinear(h, i, False, tp_rank, tp)
        self.up_proj = ColumnParallelLinear(h, i, False, tp_rank, tp)
        self.down_proj = RowParallelLinear(i, h, False, tp_rank, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        return self.down_proj(F.silu(gate) * self.up_proj(x).clamp(-self.limit, self.limit))


class V4MoE(nn.Module):
    def __init__(self, s: V4Shape, layer: int) -> None:
        super().__init__()
        self.gate = V4Gate(s, s.mlp_layer_types[layer] == "hash_moe")
        router = SqrtSoftplusTopK(s.num_experts, s.top_k, s.routed_scaling_factor)
        self.experts = FusedMoE(s.num_experts, s.top_k, s.hidden_size, s.moe_intermediate_size, router,
                                activation="silu_clamp", swiglu_limit=s.swiglu_limit, **expert_split())  # fmt: skip
        self.shared_experts = V4SharedExpert(s)
        # at --tp 1 --ep N the shared expert is whole on every rank: rank 0 alone adds it to the summed output
        ps = get_parallel()
        self.add_shared = ps.tp_size > 1 or ps.rank == 0

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        logits = self.gate(x)
        if self.gate.hashed and self.experts.routing_override is None:
            weights, ids = self.experts.router(logits, self.gate.tid2eid[input_ids])
        else:
            weights, ids = self.experts.route(logits)
        out = self.experts._experts(x, weights, ids, batch.num_valid_tokens)
        if self.add_shared:
            out = out + self.shared_experts(x)
        return all_reduce(out, over="experts")


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
                batch: ForwardBatch, latent_slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
        kernels = use_kernels(batch)
        post, comb, x = self.attn_hc(streams, kernels)
        out = all_reduce(self.self_attn(positions, self.input_layernorm(x), batch, latent_slots))  # this rank's groups' sum
        streams = HyperConnection.merge(streams, out, post, comb, kernels)
        post, comb, x = self.ffn_hc(streams, kernels)
        out = self.mlp(self.post_attention_layernorm(x), input_ids, batch)
        return HyperConnection.merge(streams, out, post, comb, kernels)


class V4MTPLayer(V4DecoderLayer):
    """MTP layer ``index`` (models/deepseek_v4_mtp.py): a decoder layer at position ``num_layers + index`` of
    ``mtp_shape``'s layer types, with its input projections and norms, its hyper-connection head and final norm."""

    def __init__(self, s: V4Shape, index: int) -> None:
        super().__init__(s, s.num_layers + index, None)
        h = s.hidden_size
        self.e_proj = Linear(h, h, bias=False)
        self.h_proj = Linear(h, h, bias=False)
        self.enorm, self.hnorm, self.norm = (RMSNorm(h, s.rms_norm_eps) for _ in range(3))
        self.hc_head = HyperHead(s.hc_mult, h, s.hc_eps, s.rms_norm_eps)

    def forward(self, *args: Any) -> torch.Tensor:
        raise NotImplementedError("DeepSeek-V4's MTP layer is kept for speculative decoding, which does not exist yet")


class V4Model(nn.Module):
    def __init__(self, s: V4Shape) -> None:
        super().__init__()
        self.hc = s.hc_mult
        ps = get_parallel()
        self.embed_tokens = VocabEmbedding(s.vocab_size, s.hidden_size, ps.tp_rank, ps.tp_size)
        # compressed layers' compact pages follow the latents in the pool's list (KVLayout.compact)
        rows = {layer: s.num_layers + i for i, layer in enumerate(s.compressed_layers)}
        self.map_index = s.num_layers + len(s.compressed_layers)  # the latent page map (KVLayout.latent_map_index)
        self.layers = nn.ModuleList(V4DecoderLayer(s, i, rows.get(i)) for i in range(s.num_layers))
        self.hc_head = HyperHead(s.hc_mult, s.hidden_size, s.hc_eps, s.rms_norm_eps)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc, -1).contiguous()
        # where each new token's latent goes, once for every layer (they share the map and the block size)
        latent_page = batch.kv_caches[self.map_index]
        slots = latent_slots(batch.slot_mapping, latent_page, batch.kv_caches[0].shape[1])
        for layer in self.layers:
            streams = layer(positions, streams, input_ids, batch, slots)
        return self.norm(self.hc_head(streams, use_kernels(batch)))


class DeepseekV4ForCausalLM(CausalLM):
    builds_windows = True  # every layer attends in its sliding window beside the compressed entries

    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.shape = s = v4_shape_from_config(config)
        try:
            self.describe(config, torch.float32, get_parallel().tp_size, get_parallel().ep_size)
        except ValueError as e:  # a split that does not divide, named by its field
            raise ModelLoadError(str(e), param="tp") from e
        self.model = V4Model(s)
        self.add_lm_head(s.hidden_size, s.vocab_size, s.tie_word_embeddings)
        # kept beside the decoder stack, never in its loop: nothing runs them until speculative decoding exists
        self.mtp = nn.ModuleList(V4MTPLayer(mtp_shape(s), i) for i in range(s.num_nextn_predict_layers)) \
            if s.num_nextn_predict_layers else None  # fmt: skip
        if self.mtp is not None:
            logger.info("DeepseekV4: %d MTP layer(s) (num_nextn_predict_layers) are built and kept, %d parameters "
                        "on this rank: unused until speculative decoding exists", len(self.mtp),
                        sum(p.numel() for p in self.mtp.parameters()))  # fmt: skip

    def needs_row_mask(self) -> bool:
        return True

    # ---- loading ---------------------------------------------------------------------------------
    def _module_name(self, name: str) -> str | None:
        """The model's name of a checkpoint tensor; None for an MTP layer's when the model keeps none."""
        mtp = mtp_module_name(name)
        if mtp is None:
            return module_name(name)
        return mtp if self.mtp is not None else None

    def map_weight_name(self, name: str) -> tuple[str, Any] | None:
        name = self._module_name(name)
        if name is None:
            return None
        hit = _EXPERT.search(name)
        if hit is not None:
            param = "w2_weight" if hit.group(2) == "w2" else "w13_weight"
            return f"{name[: hit.start()]}.experts.{param}", (int(hit.group(1)), hit.group(2))
        return super().map_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self._mtp_buffers = 0
        loaded = super().load_weights(self._split(weights))
        if self.mtp is None:
            return loaded
        if not any(key.startswith("mtp.") for key in loaded) and not self._mtp_buffers:
            # transformers saves no MTP layer (it drops ``mtp.*`` as it loads): the model holds what the checkpoint
            # has, and its config says so, which the description is computed from
            logger.info("DeepseekV4: the checkpoint holds no MTP layer (num_nextn_predict_layers=%d): none kept",
                        len(self.mtp))
            self.mtp = None
            self.config.num_nextn_predict_layers = 0
            self.shape = v4_shape_from_config(self.config)
            return loaded
        logger.info("DeepseekV4: %d MTP layer(s) loaded and kept: unused until speculative decoding exists",
                    len(self.mtp))
        return loaded

    def _split(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Expert stacks (``gate_up_proj [E, 2I, H]``: gate rows then up rows; ``down_proj [E, H, I]``) as one
        tensor per (expert, part); the routing buffers copied in place; every other tensor as it comes."""
        s = self.shape
        for ckpt_name, tensor in weights:
            name = self._module_name(ckpt_name)
            if name is None:
                continue
            if name.endswith(_BUFFERS):
                self._mtp_buffers += name.startswith("mtp.")
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
        """Per rank: this rank's ``o_groups / tp`` output groups (their heads of ``q_b_proj``, the sinks, their rows
        of ``o_a_proj`` and columns of ``o_b_proj``), the shared expert's ``1 / tp`` and the vocabulary's; the rest
        of attention (q LoRA down, the latent, compressors, indexers), norms, routers and hyper-connections whole;
        routed experts split along their intermediate size by ``--tp`` or placed by ``--ep``. The MTP layers are
        described apart (``kept_unused``): held, but read by no step. A split that does not divide is refused
        naming the field."""
        s = v4_shape_from_config(config)
        h, n, hc = s.hidden_size, s.num_layers, s.hc_mult
        split_evenly(s.o_groups, tp, "o_groups")
        shared = split_evenly(s.moe_intermediate_size, tp, "moe_intermediate_size")
        inter = s.moe_intermediate_size if ep > 1 else shared
        local_experts = split_evenly(s.num_experts, ep, "n_routed_experts")
        vocab_rows = -(-s.vocab_size // tp)
        projections, kept, float32 = _layer_params(s, range(n), "model.layers.{}.", tp, shared)
        kept += h  # the final norm
        float32 += hc * hc * h + hc + 1  # the hyper-connection head
        b = dtype.itemsize
        compact = tuple(CompactCache(s.rate(i), s.entry_width(i), 4 * s.state_floats(i)) for i in s.compressed_layers)
        kv = KVLayout(kind="latent", num_layers=n, num_heads=1, head_dim=s.head_dim, dtype=dtype, compact=compact,
                      row_dtype=dtype, latent_window=s.sliding_window)  # fmt: skip
        heads = s.num_heads // tp
        act = max(heads * s.head_dim * 2 + s.q_lora_rank, s.num_experts + s.top_k * 3 * inter + 2 * shared, hc * h * 2)
        common = dict(hidden_size=h, vocab_size=s.vocab_size, weight_bytes_per_param=b, expert_params=3 * h * inter,
                      local_experts=local_experts, num_experts=s.num_experts, top_k=s.top_k, act_width=act,
                      act_bytes_per_elem=b)  # fmt: skip
        mtp = None
        if s.num_nextn_predict_layers:
            ms, k = mtp_shape(s), s.num_nextn_predict_layers
            m_proj, m_kept, m_float32 = _layer_params(ms, range(n, n + k), "mtp.{}.", tp, shared, first=n)
            mtp_names = tuple(f"mtp.{i}." for i in range(k))
            m_proj += (Projection(h, h, 1, tuple(p + "e_proj" for p in mtp_names)),
                       Projection(h, h, 1, tuple(p + "h_proj" for p in mtp_names)))  # fmt: skip
            m_kept += k * 3 * h  # enorm, hnorm, norm
            m_float32 += k * (hc * hc * h + hc + 1)  # its hyper-connection head
            m_kept += m_float32
            mtp = ModelDescription(
                kv=kv, dense_params=sum(p.params for p in m_proj) + m_kept, embed_params=0, lm_head_params=0,
                num_moe_layers=k, model_dtype_params=m_kept, float32_params=m_float32, projections=m_proj,
                expert_layers=tuple(p + "mlp.experts" for p in mtp_names), **common,
            )  # fmt: skip
        kept += float32
        return ModelDescription(
            kv=kv, dense_params=sum(p.params for p in projections) + kept, embed_params=vocab_rows * h,
            lm_head_params=0 if s.tie_word_embeddings else vocab_rows * h, num_moe_layers=n,
            model_dtype_params=kept, float32_params=float32, projections=projections,
            expert_layers=tuple(f"model.layers.{i}.mlp.experts" for i in range(n)),
            kv_read_per_seq=partial(decode_kv_read, s, b), kept_unused=mtp, **common,
        )  # fmt: skip


def _layer_params(s: V4Shape, layers: range, prefix: str, tp: int, shared: int, first: int = 0
                  ) -> tuple[tuple[Projection, ...], int, int]:  # fmt: skip
    """The projections of decoder ``layers`` (indices into ``s.layer_types``; module names ``prefix`` formatted with
    the index less ``first``) on one rank of ``tp``, and their other parameters: (projections, model-dtype ones
    (norms, router gates), float32 ones (sinks, hyper-connections, position biases))."""
    h, d, di, q = s.hidden_size, s.head_dim, s.index_head_dim, s.q_lora_rank
    heads, groups = s.num_heads // tp, s.o_groups // tp

    def names(ls: Iterable[int], module: str) -> tuple[str, ...]:
        return tuple(prefix.format(i - first) + module for i in ls)

    csa = [i for i in layers if s.layer_types[i] == CSA]
    compressed = [i for i in layers if s.rate(i)]
    hca = [i for i in compressed if i not in csa]
    proj: list[tuple[int, int, Iterable[int], str]] = [
        (q, h, layers, "self_attn.q_a_proj"), (heads * d, q, layers, "self_attn.q_b_proj"),
        (d, h, layers, "self_attn.kv_proj"),
        (groups * s.o_lora_rank, s.num_heads * d // s.o_groups, layers, "self_attn.o_a_proj"),
        (h, groups * s.o_lora_rank, layers, "self_attn.o_b_proj"),
        (shared, h, layers, "mlp.shared_experts.gate_proj"), (shared, h, layers, "mlp.shared_experts.up_proj"),
        (h, shared, layers, "mlp.shared_experts.down_proj"),
    ]  # fmt: skip
    for part in ("kv_proj", "gate_proj"):
        proj += [(2 * d, h, csa, f"self_attn.compressor.{part}"), (d, h, hca, f"self_attn.compressor.{part}"),
                 (2 * di, h, csa, f"self_attn.compressor.indexer.{part}")]  # fmt: skip
    proj += [(s.index_n_heads * di, q, csa, "self_attn.compressor.indexer.q_b_proj"),
             (s.index_n_heads, h, csa, "self_attn.compressor.indexer.scorer.weights_proj")]  # fmt: skip
    projections = tuple(Projection(o, i, 1, names(ls, m)) for o, i, ls, m in proj if ls)
    mix = (2 + s.hc_mult) * s.hc_mult
    # float32 whatever the model dtype, as transformers keeps them: sinks, hyper-connections, position biases
    biases = sum(s.rate(i) * ((2 * d + 2 * di) if i in csa else d) for i in compressed)
    float32 = len(layers) * (heads + 2 * (mix * s.hc_mult * h + mix + 3)) + biases
    # norms (the compressors' too) and the router gates
    kept = len(layers) * (2 * h + q + d + s.num_experts * h) + len(compressed) * d + len(csa) * di
    return projections, kept, float32


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
