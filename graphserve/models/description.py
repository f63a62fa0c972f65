"""What a model family tells the engine about itself, computed from its config alone.

The KV pool, the start-up memory plan, ``graphserve plan`` and the benchmarks' floors all read a
``ModelDescription``; none of them assumes a dense Llama-shaped decoder. A family builds one in
its ``describe(config, dtype, tp, ep)`` classmethod, counting per rank:

- the KV layout (layers/kv_layout.py);
- parameters by how a decode step reads them: ``dense_params`` every step reads whole
  (attention, dense MLPs, norms, router gates, shared experts), the embedding table (a step reads
  one row per token), the lm_head (read whole; 0 when tied, then the step reads the embedding
  table as the head), and routed experts (a step reads only the experts its tokens were routed to);
- the dense projections FP8 quantizes, each by its shape and the modules holding it, and the routed-expert
  layers by name, so their scales are counted exactly and a checkpoint's ignore list can keep some in the
  model dtype (layers/quant/config.py quantized_description);
- the widest activations one token holds inside a layer, for the activation estimate.

The engine measures weights, activations and graphs at start-up; these figures are the
estimates `graphserve plan` prints before any GPU is touched, and the bytes a step must read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from graphserve.layers.kv_layout import KVLayout


@dataclass(frozen=True)
class Projection:
    """One dense projection on a rank, held by each module of ``names`` (one per layer holding it): its weight is
    ``[out_features, in_features]`` and fuses ``parts`` checkpoint modules (q/k/v: 3, gate/up: 2). The names are
    the model's own (``model.layers.0.self_attn.qkv_proj``), which an FP8 ignore list is matched against."""

    out_features: int
    in_features: int
    parts: int
    names: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def params(self) -> int:
        return self.count * self.out_features * self.in_features

    @property
    def shards(self) -> list[int] | None:
        """The fused parts' shard ids, as the module names them (layers/linear.py MergedLinear.weight_shards);
        None for a projection of one checkpoint module."""
        return list(range(self.parts)) if self.parts > 1 else None


def layer_modules(layers: Iterable[int], module: str) -> tuple[str, ...]:
    """The model's names of ``module`` (a path inside a decoder layer: ``self_attn.qkv_proj``) in each of
    ``layers``."""
    return tuple(f"model.layers.{i}.{module}" for i in sorted(layers))


@dataclass(frozen=True)
class ModelDescription:
    kv: KVLayout
    hidden_size: int
    vocab_size: int  # full vocabulary (logits are gathered to it)
    # bytes of one stored projection parameter (1 for FP8, 2 for bf16, 0.5 for FP4: two codes a byte), scales apart
    weight_bytes_per_param: float
    dense_params: int
    embed_params: int  # embedding table on this rank
    lm_head_params: int  # 0 when tied to the embedding
    expert_params: int = 0  # one routed expert of one MoE layer on this rank: its three matrices
    # one routed expert's biases (gpt-oss: gate/up's and down's), read with it, kept in the model dtype
    expert_bias_params: int = 0
    local_experts: int = 0  # routed experts per MoE layer held on this rank
    num_experts: int = 0  # routed experts per MoE layer in the model
    top_k: int = 0
    num_moe_layers: int = 0
    act_width: int = 0  # activation elements one token holds at a layer's peak (beside the residual)
    act_bytes_per_elem: int = 2
    # with FP8 projections the embedding table and lm_head stay in the model dtype, and routed experts
    # may too (layers/quant/config.py quantized_description); None: weight_bytes_per_param
    embed_bytes_per_param: int | None = None
    expert_bytes_per_param: float | None = None
    expert_fp8_group_k: int = 0  # fp8 routed experts: their scale block's K (hidden size per channel); 0: none
    # among dense_params, those FP8 keeps in the model dtype (norms, biases, router gates, MLA's kv_b_proj:
    # layers/quant/config.py MODEL_DTYPE_LAYERS; and the projections a checkpoint's ignore list keeps), priced like
    # the embedding
    model_dtype_params: int = 0
    # among model_dtype_params, those stored in float32 whatever the model dtype (attention sinks:
    # layers/attention.Attention keeps them so)
    float32_params: int = 0
    # the rest of dense_params: the projections FP8 quantizes (attention's, the dense and shared MLPs'), whose
    # scales depend on each one's shape (4 bytes per output row per channel, per tile with blocks)
    projections: tuple[Projection, ...] = ()
    dense_scale_bytes: int = 0  # FP8: the scales of ``projections`` (and static input scales), in bytes
    expert_scale_bytes: int = 0  # FP8: the scales of one routed expert of one layer, in bytes
    expert_layers: tuple[str, ...] = ()  # the model's routed-expert modules, one per MoE layer, in layer order
    # FP8: those of ``expert_layers`` whose experts a checkpoint's ignore list keeps in the model dtype while the
    # others' are fp8; priced like the embedding, with no scales. (When no layer's experts are fp8, the expert_*
    # fields above price the model dtype and this stays empty.)
    kept_expert_layers: tuple[str, ...] = ()
    # sparse attention (DeepSeek-V3.2, GLM-5): a query reads at most this many latent rows per layer, whatever its
    # context (it reads every indexer key of its context); 0: dense attention, the whole context
    attn_topk: int = 0
    # sparse attention: query rows the indexer scores per call (layers/dsa_indexer.INDEXER_ROWS); 0: no indexer
    index_score_rows: int = 0
    # the cache bytes one decode query of a given context must read, where that is no multiple of the bytes a token
    # leaves (DeepSeek-V4: a window, compressed entries, indexer keys); None: kv_read_bytes' own rule
    kv_read_per_seq: Callable[[int], int] | None = None
    # weights loaded and held but read by no step (DeepSeek-V4's MTP layers until speculative decoding exists),
    # described apart: in ``weights_bytes`` (the memory plan), not in ``num_params`` nor in what a step reads
    kept_unused: ModelDescription | None = None

    def __post_init__(self) -> None:
        # a family that lists its projections short would price the missing ones' scales at nothing
        listed = sum(p.params for p in self.projections)
        if listed != self.dense_params - self.model_dtype_params:
            raise ValueError(f"the description's projections hold {listed} parameters, but dense_params - "
                             f"model_dtype_params = {self.dense_params - self.model_dtype_params}: the family's "
                             "describe() counts them differently")
        # an ignore list is matched against the layers' names: every MoE layer needs its own
        if len(self.expert_layers) != self.num_moe_layers:
            raise ValueError(f"the description names {len(self.expert_layers)} routed-expert layers, but "
                             f"num_moe_layers = {self.num_moe_layers}: the family's describe() counts them differently")
        stray = sorted(set(self.kept_expert_layers) - set(self.expert_layers))
        if stray:
            raise ValueError(f"kept_expert_layers names {stray[0]!r}, which is none of the description's expert_layers")

    @property
    def _embed_bpp(self) -> int:
        return self.weight_bytes_per_param if self.embed_bytes_per_param is None else self.embed_bytes_per_param

    @property
    def dense_bytes(self) -> int:
        """Every dense parameter: the projections at ``weight_bytes_per_param`` and their scales,
        ``model_dtype_params`` at the model dtype's (the same figure but under FP8), ``float32_params`` at 4 bytes."""
        kept = self.model_dtype_params
        return int((self.dense_params - kept) * self.weight_bytes_per_param) + self.dense_scale_bytes + \
            (kept - self.float32_params) * self._embed_bpp + 4 * self.float32_params

    @property
    def _expert_bpp(self) -> int:
        return self.weight_bytes_per_param if self.expert_bytes_per_param is None else self.expert_bytes_per_param

    # ---- weights ---------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0

    @property
    def num_params(self) -> int:
        experts = self.num_moe_layers * self.local_experts * (self.expert_params + self.expert_bias_params)
        return self.dense_params + self.embed_params + self.lm_head_params + experts

    @property
    def weights_bytes(self) -> int:
        experts = self.local_experts * sum(self._layer_expert_bytes(name) for name in self.expert_layers)
        embed = (self.embed_params + self.lm_head_params) * self._embed_bpp
        unused = self.kept_unused.weights_bytes if self.kept_unused is not None else 0
        return self.dense_bytes + embed + experts + unused

    @property
    def expert_bytes(self) -> int:
        """One routed expert of one layer, with its scales (a layer of ``kept_expert_layers`` apart)."""
        return int(self.expert_params * self._expert_bpp) + self.expert_scale_bytes + \
            self.expert_bias_params * self._embed_bpp

    def _layer_expert_bytes(self, layer: str) -> int:
        """One routed expert of MoE layer ``layer``: in the model dtype without scales when the layer is kept."""
        if layer in self.kept_expert_layers:
            return (self.expert_params + self.expert_bias_params) * self._embed_bpp
        return self.expert_bytes

    # ---- what a decode step must read --------------------------------------------------------
    def head_bytes(self) -> int:
        """The lm_head, or the tied embedding table acting as the head."""
        return (self.lm_head_params or self.embed_params) * self._embed_bpp

    def decode_read_bytes(self, batch: int, context_tokens: int | Sequence[int],
                          experts_touched: int | Sequence[int] | None = None) -> int:
        """Bytes a decode step of ``batch`` tokens must read from device memory, each at least once.

        ``context_tokens``: KV positions attended over, summed across the batch, or one count per sequence (a
        sparse-attention model's floor needs them when they differ: ``kv_read_bytes``). ``experts_touched``:
        distinct (layer, expert) pairs the router chose in that step, summed over MoE layers, or one count
        per MoE layer (``expert_layers``' order), which a model whose layers price experts apart
        (``kept_expert_layers``) needs; when unknown, the fewest that ``batch`` tokens can touch (top_k of
        them per layer) — a floor.
        """
        weights = self.dense_bytes + self.head_bytes()
        rows = batch * self.hidden_size * self._embed_bpp  # the batch's embedding rows
        return int(weights + rows + self._experts_read(experts_touched) + self.kv_read_bytes(batch, context_tokens))

    def kv_read_bytes(self, batch: int, context_tokens: int | Sequence[int]) -> int:
        """The KV a decode step of ``batch`` sequences must read: every cached byte of their contexts, or with sparse
        attention every indexer key but at most ``attn_topk`` latent rows a sequence and layer. A summed count is
        taken as ``batch`` equal contexts (how the benchmarks build their batches); since ``min(c, k)`` is concave,
        unequal contexts read less, so pass one count per sequence for them."""
        per_seq = [context_tokens / max(batch, 1)] * batch if isinstance(context_tokens, int) else list(context_tokens)
        if self.kv_read_per_seq is not None:
            return sum(self.kv_read_per_seq(int(c)) for c in per_seq)
        total = sum(per_seq)
        if not self.attn_topk:
            return int(total * self.kv.bytes_per_token)
        latent = self.kv.bytes_per_token - self.kv.index_bytes_per_token
        return int(total * self.kv.index_bytes_per_token + sum(min(c, self.attn_topk) for c in per_seq) * latent)

    def _experts_read(self, touched: int | Sequence[int] | None) -> int:
        if touched is None:
            touched = [min(self.local_experts, self.top_k)] * self.num_moe_layers
        elif isinstance(touched, int):
            if self.kept_expert_layers:
                raise ValueError(f"experts_touched={touched} sums the MoE layers, but {len(self.kept_expert_layers)} "
                                 f"of the {self.num_moe_layers} keep their experts in the model dtype: pass one "
                                 "count per MoE layer")
            return touched * self.expert_bytes
        if len(touched) != self.num_moe_layers:
            raise ValueError(f"experts_touched has {len(touched)} counts: expected one per MoE layer "
                             f"({self.num_moe_layers})")
        return sum(n * self._layer_expert_bytes(name) for name, n in zip(self.expert_layers, touched))

    # ---- what a step holds ----------------------------------------------------------------------
    def activation_bytes(self, tokens: int, sampled_rows: int | None = None, context_tokens: int = 0) -> int:
        """Peak live activations of one forward over ``tokens`` new tokens (layers run one at a time).

        The residual stream and its normed copy (2·T·hidden), the widest per-token intermediates of a
        layer (``act_width``), logits of the sampled rows in fp32, and ``context_tokens`` of KV gathered
        contiguously (what the eager attention path does when no paged kernel runs).
        """
        per_layer = (2 * tokens * self.hidden_size + tokens * self.act_width) * self.act_bytes_per_elem
        gather = context_tokens * self.kv.bytes_per_token_per_layer
        rows = tokens if sampled_rows is None else sampled_rows
        return int(per_layer + gather + rows * self.vocab_size * 4)

    def index_scores_bytes(self, tokens: int, max_len: int) -> int:
        """What one indexer call over ``tokens`` rows holds at a context bound of ``max_len`` (the block tables' width,
        up to --max-model-len): fp32 scores per row and position, and the int64 keys the torch.topk form of the top-k
        sorts (kernels/dsa_topk.py). A prefill at a long context holds far more than the start-up profile's short
        synthetic sequences did, so the plan adds it; 0 without an indexer."""
        if not self.index_score_rows:
            return 0
        return min(tokens, self.index_score_rows) * max_len * (4 + 8)

    def moe_workspace_bytes(self, tokens: int) -> int:
        """What one MoE layer's fused path allocates for ``tokens`` rows (layers run one at a time,
        so this is part of the activation peak, not added to it); 0 for a dense model."""
        if not self.is_moe:
            return 0
        from graphserve.kernels.moe_fused import moe_workspace_bytes

        dtype = torch.float32 if self.act_bytes_per_elem == 4 else torch.bfloat16  # only its size is read
        inter = self.expert_params // (3 * self.hidden_size)
        return moe_workspace_bytes(tokens, self.top_k, self.local_experts, inter, self.hidden_size, dtype,
                                   fp8_group_k=self.expert_fp8_group_k)

    def fp4_dequant_bytes(self, tokens: int) -> int:
        """What the dense FP4 GEMM's "dequant" or "dequant_fp8" variant (kernels/fp4_gemm.py) holds for a call of
        ``tokens`` rows, the larger of the two (the card's table picks per shape): its largest FP4 projection
        dequantized to the model dtype, or converted to e4m3 (one byte a weight) beside x quantized per token (a byte
        an element and a scale a row), for as long as that projection runs (part of the activation peak); 0 without
        FP4 projections, or at rows neither serves."""
        from graphserve.kernels.fp4_gemm_config import DEQUANT_ABOVE_ROWS

        if self.weight_bytes_per_param != 0.5 or not self.projections or tokens <= DEQUANT_ABOVE_ROWS:
            return 0
        return max(max(n * k * self.act_bytes_per_elem, n * k + tokens * (k + 4))
                   for n, k in ((p.out_features, p.in_features) for p in self.projections))

    def graph_pool_bytes(self, sizes: Sequence[int], context_tokens: int = 0) -> int:
        """CUDA graphs are captured largest first into one pool: intermediates cost one activation
        peak of the largest size; each graph's outputs (fp32 logits, last hidden state) stay alive."""
        if not sizes:
            return 0
        peak = self.activation_bytes(max(sizes), context_tokens=context_tokens)
        outputs = sum(bs * (self.vocab_size * 4 + self.hidden_size * self.act_bytes_per_elem) for bs in sizes)
        return int(peak + outputs)
