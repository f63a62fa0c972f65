"""The explicit per-step batch passed down the forward call (no hidden global state).

Token layout: the new tokens of every sequence in the step, flattened in sequence order.
KV layout: one tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``;
a token's *slot* is ``block_id * block_size + offset``. Block 0 is reserved as the dummy block:
the block manager never hands it out, and padding rows (CUDA-graph padding) write there, so
they can never touch a real request's KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from graphserve.layers.attention import AttentionBackend

DUMMY_BLOCK = 0

Mode = Literal["prefill", "decode", "mixed"]


@dataclass
class ForwardBatch:
    mode: Mode  # "decode": every sequence has exactly one new token
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64, KV slot each new token writes
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with DUMMY_BLOCK
    logits_indices: torch.Tensor  # [B] int64, index in T of each sequence's last new token
    max_query_len: int
    max_seq_len: int
    kv_caches: list[torch.Tensor] = field(default_factory=list)  # one per layer
    attn_backend: AttentionBackend | None = None
    # host-side copies for the CPU backend and bookkeeping (never read on the GPU hot path)
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
