"""The CUDA MLA backend: the fused prologue kernel, then absorbed attention over the latent cache.

Per layer and step: one prologue launch (kv-a norm, rotary on q and k, cache write); ``q_nope``
absorbed into latent space with one batched matmul over heads (``W_UK``, a view of ``kv_b_proj``);
the attention kernel (split-KV decode, causal extend); ``W_UV`` applied with a second batched
matmul. Nothing syncs with the host and every shape is static per batch size, so decode steps
capture into CUDA graphs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from graphserve.kernels.mla_attention import mla_attention
from graphserve.kernels.mla_config import MLATile
from graphserve.kernels.mla_prologue import mla_prologue

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch
    from graphserve.layers.mla import MLAttention


class TritonMLABackend:
    name = "triton"

    def __init__(self, decode_tile: MLATile | None = None, extend_tile: MLATile | None = None) -> None:
        # tile overrides; None: kernels/mla_config.py's choice (the measured rule, else the code defaults)
        self.decode_tile, self.extend_tile = decode_tile, extend_tile

    def forward(self, layer: MLAttention, q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:  # fmt: skip
        cache = batch.kv_caches[layer.layer_idx]
        rotary = layer.rotary[0]
        mla_prologue(q, kv_a, positions, rotary.cos_sin_cache, layer.kv_a_layernorm.weight, layer.kv_a_layernorm.eps,
                     cache, batch.slot_mapping, layer.nope, rotary.interleaved)
        q_lat = layer.absorb_query(q[..., : layer.nope])  # [H, T, r]
        q_rope = q[..., layer.nope :]
        decode = batch.mode == "decode"
        o_lat = torch.empty_like(q_lat)
        mla_attention(
            q_lat.transpose(0, 1), q_rope, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            layer.scale, max_query_len=1 if decode else batch.max_query_len, out=o_lat.transpose(0, 1),
            tile=self.decode_tile if decode else self.extend_tile,
        )  # fmt: skip
        return layer.unabsorb_output(o_lat)
