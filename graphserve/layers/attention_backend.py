"""The attention backend interface. The model's attention layer calls exactly this.

Backends: ``TorchAttentionBackend`` (CPU and reference, layers/attention.py) and the Triton
backend (GPU, layers/attention_triton.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from graphserve.engine.forward_batch import ForwardBatch


class AttentionBackend:
    """Writes the step's K/V into the paged cache, then attends.

    Shapes: q ``[T, num_heads, head_dim]``; k, v ``[T, num_kv_heads, head_dim]``;
    ``batch.kv_caches[layer_idx]`` is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
    Sequence i owns new tokens ``q[qs[i]:qs[i+1]]`` (qs = batch.query_start_loc) at absolute
    positions ``seq_lens[i] - qlen_i + j``; token j attends causally to cache positions
    ``0 .. seq_lens[i] - qlen_i + j`` of its block table (cached prefix + new tokens).
    Returns ``[T, num_heads, head_dim]`` in q's dtype.
    """

    name = "abstract"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        raise NotImplementedError
