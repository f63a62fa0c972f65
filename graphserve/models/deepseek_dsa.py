"""DeepSeek sparse attention families: DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5
(``GlmMoeDsaForCausalLM``).

Both are DeepSeek-V3 (models/deepseek.py: MLA with a q LoRA, grouped-sigmoid routing, shared experts) whose
attention layers attend only over the ``index_topk`` positions a lightning indexer selects for each query
token (layers/dsa_indexer.py, layers/dsa_attention.py). Dense and MoE layers follow ``mlp_layer_types``.
They differ in two things:

- the indexer's rope: GLM-5 rotates its first ``qk_rope_head_dim`` dims as interleaved pairs, DeepSeek-V3.2
  as two halves (MLA's own rope is interleaved in both, as transformers applies it);
- GLM-5's ``indexer_types``: a "full" layer runs its own indexer, a "shared" one has none and reuses the
  selection of the layer before it (so a run of shared layers reuses the last full layer's).

The KV pool holds, per token, the latent of every layer and one indexer key per "full" layer, in one paged
pool (layers/kv_layout.py). Under ``--tp`` attention heads split as MLA's do and the indexer is replicated.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphserve.distributed.comm import all_reduce
from graphserve.distributed.state import get_parallel
from graphserve.errors import ConfigError
from graphserve.layers.dsa_attention import DsaAttention
from graphserve.layers.dsa_indexer import INDEXER_ROWS, DsaIndexer, DsaStep
from graphserve.layers.embedding import VocabEmbedding
from graphserve.layers.linear import norm_mlp
from graphserve.layers.mla_rope import DeepseekRotary, softmax_scale
from graphserve.layers.norm import RMSNorm
from graphserve.layers.quant.config import DEQUANTIZED_AT_LOAD
from graphserve.models.base import DecoderStack
from graphserve.models.deepseek import DeepseekMLP, DeepseekMoE, DeepseekV3ForCausalLM
from graphserve.models.deepseek_dsa_shape import DsaShape, dsa_shape_from_config
from graphserve.models.deepseek_shape import DeepseekShape
from graphserve.models.description import ModelDescription

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch

# The page sizes the DSA kernels (kernels/dsa.py) are built and tested for; a larger page is refused until its
# gathers are measured
DSA_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)


class DsaDecoderLayer(nn.Module):
    def __init__(self, d: DsaShape, layer_idx: int, rotary: DeepseekRotary, cache_index: int | None) -> None:
        super().__init__()
        s = d.base
        ps = get_parallel()
        indexer = None
        if cache_index is not None:
            indexer = DsaIndexer(s.hidden_size, s.q_lora_rank, d.index_n_heads, d.index_head_dim, s.qk_rope_head_dim,
                                 d.index_topk, rotary, d.index_rope_interleave, cache_index)  # fmt: skip
        self.self_attn = DsaAttention(
            s.hidden_size, s.num_heads, s.q_lora_rank, s.kv_lora_rank, s.qk_nope_head_dim, s.qk_rope_head_dim,
            s.v_head_dim, s.attention_bias, rotary, softmax_scale(s.qk_nope_head_dim + s.qk_rope_head_dim, s.rope),
            layer_idx, ps.tp_rank, ps.tp_size, indexer=indexer,
        )  # fmt: skip
        self.is_moe = layer_idx in s.moe_layers
        self.mlp = DeepseekMoE(s) if self.is_moe else DeepseekMLP(s.hidden_size, s.intermediate_size, s.mlp_bias)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch, step: DsaStep) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        # the indexer reads the normed hidden state itself (wk, weights_proj), so the norm runs apart from the
        # fused q-a/kv-a projection
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        fused = self.self_attn.fused_qkv_a_proj(normed)
        hidden = all_reduce(self.self_attn(positions, fused, normed, batch, step))
        if self.is_moe:
            return self.mlp.forward_add_norm(hidden, residual, self.post_attention_layernorm, batch)
        out, residual = norm_mlp(self.post_attention_layernorm, hidden, residual, self.mlp.gate_up_proj,
                                 self.mlp.down_proj)
        return all_reduce(out), residual


class DsaModel(DecoderStack):
    def __init__(self, d: DsaShape, max_positions: int) -> None:
        super().__init__()
        s = d.base
        ps = get_parallel()
        self.embed_tokens = VocabEmbedding(s.vocab_size, s.hidden_size, ps.tp_rank, ps.tp_size)
        self.rotary_emb = DeepseekRotary(s.qk_rope_head_dim, max_positions, s.rope, s.max_position_embeddings,
                                         s.rope_interleave)
        # indexer key caches follow the latent caches in the pool's list (layers/kv_layout.py)
        slot = {layer: s.num_layers + i for i, layer in enumerate(d.indexer_layers)}
        self.layers = nn.ModuleList(DsaDecoderLayer(d, i, self.rotary_emb, slot.get(i)) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> torch.Tensor:
        step = DsaStep.of(batch, input_ids.shape[0], batch.kv_caches[0].shape[1])
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch, step)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: an indexer in every layer, its rope in two halves."""

    index_rope_interleave = False
    shared_indexers = False  # whether config.indexer_types is read
    # the indexer runs in the model dtype (layers/dsa_indexer.py): an FP8 checkpoint's indexer projections are
    # dequantized as they load, as MLA's kv_b_proj is
    dequantized_at_load = DEQUANTIZED_AT_LOAD + (".indexer.wq_b", ".indexer.wk", ".indexer.weights_proj")

    def build_model(self, config: Any, max_positions: int) -> nn.Module:
        self.dsa = self.dsa_shape(config)
        self.shape = self.dsa.base
        return DsaModel(self.dsa, max_positions)

    @classmethod
    def dsa_shape(cls, config: Any) -> DsaShape:
        return dsa_shape_from_config(config, cls.__name__, cls.index_rope_interleave, cls.shared_indexers)

    @classmethod
    def config_shape(cls, config: Any) -> DeepseekShape:
        return cls.dsa_shape(config).base

    @classmethod
    def check_block_size(cls, block_size: int) -> None:
        """The paged caches' block size is refused at load when the DSA kernels are not built for it."""
        if block_size not in DSA_BLOCK_SIZES:
            raise ConfigError(f"--block-size={block_size} is not built for {cls.__name__}'s sparse attention: "
                              f"choose one of {', '.join(map(str, DSA_BLOCK_SIZES))}", param="block_size")

    @classmethod
    def describe(cls, config: Any, dtype: torch.dtype, tp: int = 1, ep: int = 1) -> ModelDescription:
        """DeepSeek-V3's description (models/deepseek.py) plus, on every rank, each indexer whole (``wq_b``,
        ``wk``, ``k_norm``, ``weights_proj``: kept in the model dtype) and its key cache, one
        ``index_head_dim`` key per token per indexer layer."""
        d = super().describe(config, dtype, tp=tp, ep=ep)
        ds = cls.dsa_shape(config)
        h, q_lora, heads, dim = ds.base.hidden_size, ds.base.q_lora_rank, ds.index_n_heads, ds.index_head_dim
        n = len(ds.indexer_layers)
        indexer = q_lora * heads * dim + h * dim + 2 * dim + h * heads
        kv = dataclasses.replace(d.kv, index_layers=n, index_head_dim=dim, index_dtype=dtype)
        # a token at the indexer's peak: its query heads, its key and its head weights (fp32)
        act = heads * dim + dim + 2 * heads
        return dataclasses.replace(d, kv=kv, attn_topk=ds.index_topk, index_score_rows=INDEXER_ROWS,
                                   dense_params=d.dense_params + n * indexer,
                                   model_dtype_params=d.model_dtype_params + n * indexer,
                                   act_width=max(d.act_width, act))


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: interleaved indexer rope; ``indexer_types`` "shared" layers reuse the previous layer's selection."""

    index_rope_interleave = True
    shared_indexers = True
