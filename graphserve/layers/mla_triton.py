"""The CUDA MLA backend: the fused prologue kernel, then absorbed attention over the latent cache.

Per layer and step: one prologue launch (kv-a norm, rotary on q and k, cache write). Decode:
``q_nope`` absorbed into latent space with one batched matmul over heads (``W_UK``, a view of
``kv_b_proj``); the split-KV attention kernel; ``W_UV`` applied with a second batched matmul. Nothing
syncs with the host and every shape is static per batch size, so decode steps capture into CUDA
graphs. Prefill/extend: chunks of two or more tokens in the expanded form, single-token rows of a
mixed step through the decode kernel (layers/mla_expanded.py says why, with the measurements).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from graphserve.kernels.mla_attention import mla_attention, warm_tiles
from graphserve.kernels.mla_config import MLATile, cache_kind, decode_tiles
from graphserve.kernels.mla_prologue import mla_prologue
from graphserve.layers.mla_expanded import absorbed_rows, expanded_extend

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch
    from graphserve.layers.mla_types import LatentAttentionLayer


class TritonMLABackend:
    name = "triton"

    def __init__(self, decode_tile: MLATile | None = None) -> None:
        # a decode tile override; None: kernels/mla_config.py's choice (the measured rule, else the code defaults)
        self.decode_tile = decode_tile

    def warmup_work(self, layer: LatentAttentionLayer, cache: torch.Tensor, max_model_len: int) -> list[tuple]:
        """One ``(key, run)`` per decode tile the card's rule may pick for this layer's heads and cache: the tile
        follows the step's batch and block-table width, which served traffic takes wider than the warm-up's
        steps do (kernels/mla_config.decode_tiles)."""
        dtype, page = layer.w_uk().dtype, cache.shape[1]
        tiles = (self.decode_tile,) if self.decode_tile is not None else \
            decode_tiles(layer.num_heads, dtype, cache.device, cache_kind(cache.dtype))
        shape = (layer.num_heads, layer.nope, layer.kv_lora_rank, layer.rope, page, dtype, cache.dtype, cache.device,
                 max_model_len + page)  # a block table holds up to a block past the longest sequence
        return [(("mla_decode", tile, *shape), functools.partial(warm_tiles, (tile,), *shape)) for tile in tiles]

    def forward(self, layer: LatentAttentionLayer, q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:  # fmt: skip
        cache = batch.kv_caches[layer.layer_idx]
        rotary = layer.rotary[0]
        mla_prologue(q, kv_a, positions, rotary.cos_sin_cache, layer.kv_a_layernorm.weight, layer.kv_a_layernorm.eps,
                     cache, batch.slot_mapping, layer.nope, rotary.interleaved)
        if batch.mode != "decode":
            return self.extend(layer, q, cache, batch)
        q_lat = layer.absorb_query(q[..., : layer.nope])  # [H, T, r]
        o_lat = torch.empty_like(q_lat)
        mla_attention(
            q_lat.transpose(0, 1), q[..., layer.nope :], cache, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, layer.scale, max_query_len=1, out=o_lat.transpose(0, 1), tile=self.decode_tile,
        )  # fmt: skip
        return layer.unabsorb_output(o_lat)

    def extend(self, layer: LatentAttentionLayer, q: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Chunks of two or more tokens expanded, single-token rows absorbed; ``[T, H, v]``."""
        query_lens = batch.query_lens_cpu or torch.diff(batch.query_start_loc).tolist()
        seq_lens = batch.seq_lens_cpu or batch.seq_lens.tolist()
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_dim)
        singles, tokens, start = [], [], 0
        for i, qlen in enumerate(query_lens):
            if qlen == 1:
                singles.append(i)
                tokens.append(start)
            start += qlen
        if singles:
            absorbed_rows(layer, q, cache, batch.block_tables, batch.seq_lens, singles, tokens, out,
                          self.decode_tile)  # fmt: skip
        expanded_extend(q, cache, layer.w_kv_b(), batch.block_tables, query_lens, seq_lens, layer.nope, layer.scale,
                        out, min_query_len=2)  # fmt: skip
        return out
