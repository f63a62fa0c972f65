"""DeepSeek sparse attention: MLA (layers/mla.py) over the positions an indexer selected (layers/dsa_indexer.py).

The projections, the latent cache and the absorbed ``W_UK`` / ``W_UV`` views are MLA's. What changes is the
attention: every row (a prefill, extend or decode token alike) attends in latent space over only its selected
positions (``sparse_mla``), so prefill, chunked prefill and decode compute the same thing for the same token. A
layer that owns an indexer selects for itself; a GLM-5 "shared" layer reuses the selection of the layer before
it (the step's ``DsaStep.idx``).

Under ``--tp`` the heads split as MLA's do, over a replicated latent cache; the indexer is replicated too
(layers/dsa_indexer.py), so every rank's heads attend over the same positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from graphserve.kernels.mla_prologue import write_latent_cache
from graphserve.layers.dsa_indexer import DsaIndexer, DsaStep, dsa_ops
from graphserve.layers.mla import MLAttention

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch


class DsaAttention(MLAttention):
    """MLA with a q LoRA (the indexer reads its latent) and an optional indexer of its own."""

    def __init__(self, *args, indexer: DsaIndexer | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.indexer = indexer

    def warmup_work(self, attn_backend, kv_caches: list[torch.Tensor], max_model_len: int) -> list[tuple]:
        # sparse_mla, not the dense decode kernel, and its tile is the code default per head count: the steps reach it
        return []

    def forward(self, positions: torch.Tensor, fused: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                step: DsaStep) -> torch.Tensor:  # fmt: skip
        """Attention from the fused q-a/kv-a projection's output ``[T, q_lora + r + d]`` and the normed hidden
        state the indexer reads; returns ``o_proj``'s ``[T, hidden]`` (a partial sum under ``--tp``)."""
        t, r = fused.shape[0], self.kv_lora_rank
        q_a, kv_a = fused.split(self.fused_qkv_a_proj.output_sizes, dim=-1)
        q_resid = self.q_a_layernorm(q_a)
        if self.indexer is not None:
            step.idx = self.indexer(q_resid, hidden, positions, batch, step)
        elif step.idx is None:
            raise RuntimeError(f"layer {self.layer_idx} shares a selection, but no earlier layer made one")
        q = self.q_b_proj(q_resid).view(t, self.num_heads, self.qk_dim)
        rotary = self.rotary[0]
        latent = self.kv_a_layernorm(kv_a[:, :r].contiguous())
        k_rope = rotary(kv_a[:, None, r:], positions)[:, 0]
        q_rope = rotary(q[..., self.nope :], positions)
        cache = batch.kv_caches[self.layer_idx]
        write_latent_cache(latent, k_rope, cache, batch.slot_mapping)
        q_lat = self.absorb_query(q[..., : self.nope]).transpose(0, 1).contiguous()  # [T, H, r]
        o_lat = dsa_ops(batch).sparse_mla(q_lat, q_rope, cache, batch.block_tables, step.row_seq, step.idx,
                                          self.scale)  # fmt: skip
        out = self.unabsorb_output(o_lat.transpose(0, 1))
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))
