"""The lightning indexer of DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): which earlier positions each query
token's MLA attends over.

Per layer that owns one, the indexer projects the q LoRA latent (``q_a_layernorm(q_a_proj(x))``) into
``index_n_heads`` query heads (``wq_b``) and the normed hidden state into one key (``wk``, then the LayerNorm
``k_norm``) and one weight per head (``weights_proj``). The first ``qk_rope_head_dim`` dims of each query head
and of the key are rotated with the model's rope table (interleaved pairs for GLM-5, two halves for
DeepSeek-V3.2); the rest pass through. A query at position p scores every position j <= p as
``sum_h w_h * relu(q_h . k_j)`` and keeps the ``index_topk`` best; with p + 1 <= index_topk that is every
position (the model's own semantics: nothing is dropped until the context outgrows the budget).

transformers scales as ``w_h * n_heads^-0.5 * relu(head_dim^-0.5 * q_h . k_j)``; both scales are positive, so
they are folded into the weights here and the kernels see plain dot products.

Ties are broken by position, the lower one winning (kernels/dsa_reference.topk_indices): the selection of a
query depends only on its scores, never on how the step was cut, so prefill, chunked prefill and decode select
the same positions for the same token.

The keys are cached (``[num_blocks, block_size, index_head_dim]`` per indexer layer, paged like the latent:
layers/kv_layout.py), so a later step scores its queries against every earlier token without recomputing them.

Under ``--tp`` the indexer is replicated: every rank holds its projections whole and the whole key cache (as it
holds the latent), computes the same selection from the same all-reduced hidden state, and its attention heads,
whichever they are, read that selection. Splitting the indexer's heads would add an all-reduce of ``[T, L]``
scores per layer before the top-k, larger than the work it saves.

Its projections are plain ``nn.Linear`` (never FP8-quantized at load): a small share of the weights, and the
selection's ranking is what the model's accuracy depends on.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from graphserve.kernels.mla_prologue import rotate

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch
    from graphserve.layers.mla_rope import DeepseekRotary

# transformers' DeepseekV32Indexer builds k_norm with this eps whatever rms_norm_eps says
K_NORM_EPS = 1e-6
# A prefill chunk scores its rows in slices of this many: the scores are [rows, context] fp32, which for 2048
# rows over a 160k context would be 1.3 GB; 256 rows hold it to 160 MB, and each slice is still a large launch
INDEXER_ROWS = 256


def dsa_ops(batch: ForwardBatch) -> ModuleType:
    """The DSA functions for the step's attention backend: the Triton kernels exactly when the engine chose its
    Triton backend, so a run on the Torch backend stays the pure-PyTorch reference."""
    if getattr(batch.attn_backend, "name", "torch") == "triton":
        from graphserve.kernels import dsa

        return dsa
    from graphserve.kernels import dsa_reference

    return dsa_reference


@dataclass
class DsaStep:
    """What every sparse layer of one step shares: each row's sequence and position, the static bound of the
    scores' width, and the last indexer's selection (read by GLM-5's "shared" layers)."""

    row_seq: torch.Tensor  # [T] int32
    row_pos: torch.Tensor  # [T] int32
    max_len: int  # >= every row_pos + 1; the block tables' width, static under CUDA graphs
    idx: torch.Tensor | None = None  # [T, index_topk] int32, -1 padded

    @classmethod
    def of(cls, batch: ForwardBatch, num_tokens: int, block_size: int) -> DsaStep:
        row_seq, row_pos = dsa_ops(batch).token_rows(batch.query_start_loc, batch.seq_lens, num_tokens)
        return cls(row_seq, row_pos, int(batch.block_tables.shape[1]) * block_size)


class DsaIndexer(nn.Module):
    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int, topk: int,
                 rotary: DeepseekRotary, interleaved: bool, cache_index: int) -> None:  # fmt: skip
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.interleaved = interleaved
        self.cache_index = cache_index  # where this layer's key cache sits in batch.kv_caches
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=K_NORM_EPS)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)
        self.weight_scale = head_dim**-0.5 * n_heads**-0.5
        self.rotary = [rotary]  # a list, so the shared module is not registered once per layer

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate the first ``rope_dim`` dims of ``x [T, n, D]``; the rest pass through."""
        d = self.rope_dim
        rotated = rotate(x[..., :d], positions, self.rotary[0].cos_sin_cache, self.interleaved)
        return torch.cat((rotated, x[..., d:]), dim=-1)

    def forward(self, q_resid: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                step: DsaStep) -> torch.Tensor:  # fmt: skip
        """Write this step's keys and return each row's selected positions ``[T, topk]`` int32 (-1 padded)."""
        t = hidden.shape[0]
        q = self._rope(self.wq_b(q_resid).view(t, self.n_heads, self.head_dim), positions)
        k = self._rope(self.k_norm(self.wk(hidden))[:, None], positions)[:, 0]
        weights = self.weights_proj(hidden).float() * self.weight_scale
        ops = dsa_ops(batch)
        cache = batch.kv_caches[self.cache_index]
        ops.write_index_cache(k, cache, batch.slot_mapping)
        if t <= INDEXER_ROWS:  # decode and graph-captured steps: one call, no Python loop
            return ops.indexer_topk(q, weights, cache, batch.block_tables, step.row_seq, step.row_pos, step.max_len,
                                    self.topk)
        return torch.cat([ops.indexer_topk(q[i : i + INDEXER_ROWS], weights[i : i + INDEXER_ROWS], cache,
                                           batch.block_tables, step.row_seq[i : i + INDEXER_ROWS],
                                           step.row_pos[i : i + INDEXER_ROWS], step.max_len, self.topk)
                          for i in range(0, t, INDEXER_ROWS)])  # fmt: skip
