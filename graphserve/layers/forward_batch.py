"""The explicit per-step batch passed down the forward call (no hidden global state).

Token layout: the new tokens of every sequence in the step, flattened in sequence order.
KV layout: one tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``;
a token's *slot* is ``block_id * block_size + offset``. Block 0 is reserved as the dummy block:
the block manager never hands it out, and padding rows (CUDA-graph padding) write there, so
they can never touch a real request's KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from graphserve.kernels.paged_kv import DUMMY_BLOCK

Mode = Literal["prefill", "decode", "mixed"]


class StepAttention(Protocol):
    """What a layer calls on the step's ``attn_backend``: the interface of layers/attention_backend.AttentionBackend,
    which every backend implements and whose docstring gives the shapes. Declared here, below the backends, so that
    the batch they all take does not import them back."""

    name: str
    fused_prologue: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, batch: ForwardBatch,
                scale: float, *, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor: ...

    def attend(self, q: Any, layer_idx: int, batch: ForwardBatch, scale: float, *, window: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor: ...


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
    attn_backend: StepAttention | None = None
    # real rows of a padded batch (CUDA-graph padding), as a device scalar: rows past it route to no
    # expert in MoE layers (an MoE model turns it into a bool row mask [T] once per step). None: every
    # row is real.
    num_valid_tokens: torch.Tensor | None = None
    # host-side copies for the CPU backend and bookkeeping (never read on the GPU hot path)
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def contiguous_batch(
    query_lens: list[int],
    context_lens: list[int],
    kv_caches: list[torch.Tensor],
    attn_backend: StepAttention | None,
    vocab_size: int,
    first_block: int = 1,
    *,
    num_blocks: int | None = None,
    latent_pages: int | None = None,
) -> ForwardBatch:
    """A synthetic batch on consecutive blocks, for start-up profiling and benchmarks.

    Sequence i holds ``context_lens[i]`` tokens after the step, the last ``query_lens[i]`` of them
    new; its blocks follow the previous sequence's, starting at ``first_block``. Input ids are
    random in ``[0, vocab_size)``; the cache contents are whatever the pool holds.

    ``num_blocks``: the pool's blocks, the dummy block included; None: the first cache's, which only a pool whose
    first cache is indexed by block has (K/V, an MLA latent, a latent allocated one page a block). ``latent_pages``:
    where the latents are paged apart (layers/kv_layout.py ``latent_window``, allocated with a page count, which
    ``num_blocks`` must then give), their pages, the dummy page included: every block past the dummy stands for a
    page, as a running sequence's newest block holds one, so no batch is built that the block manager could never
    run (a decode batch of more rows than usable pages).
    """
    if len(query_lens) != len(context_lens) or any(q < 1 or q > c for q, c in zip(query_lens, context_lens)):
        raise ValueError(f"need 1 <= query_len <= context_len per sequence, got {query_lens} / {context_lens}")
    cache = kv_caches[0]  # [2, blocks, block_size, heads, dim] (K/V) or [blocks, block_size, 1, dim] (latent)
    block_size = cache.shape[2] if cache.dim() == 5 else cache.shape[1]
    if num_blocks is None:
        if latent_pages is not None:  # the first cache holds the pages, not the blocks
            raise ValueError(f"latent_pages={latent_pages} needs the pool's num_blocks too")
        num_blocks = cache.shape[1] if cache.dim() == 5 else cache.shape[0]
    device = kv_caches[0].device
    tables, slots, positions, qsl = [], [], [], [0]
    block = first_block
    for q, c in zip(query_lens, context_lens):
        n = -(-c // block_size)
        table = list(range(block, block + n))
        block += n
        tables.append(table)
        positions += range(c - q, c)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c - q, c)]
        qsl.append(qsl[-1] + q)
    if block > num_blocks:
        raise ValueError(f"the synthetic batch needs {block} blocks, the pool has {num_blocks}")
    paged = block - max(first_block, 1)  # blocks past the dummy
    if latent_pages is not None and paged > latent_pages - 1:
        raise ValueError(f"the synthetic batch needs {paged} latent pages (one a block past the dummy), the pool has "
                         f"{latent_pages - 1} besides the dummy page")
    width = max(len(t) for t in tables)
    if all(q == 1 for q in query_lens):
        mode = "decode"
    elif query_lens == context_lens:
        mode = "prefill"
    else:
        mode = "mixed"
    return ForwardBatch(
        mode=mode,
        input_ids=torch.randint(0, vocab_size, (qsl[-1],), device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [DUMMY_BLOCK] * (width - len(t)) for t in tables], dtype=torch.int32,
                                  device=device),
        logits_indices=torch.tensor(qsl[1:], dtype=torch.int64, device=device) - 1,
        max_query_len=max(query_lens),
        max_seq_len=max(context_lens),
        kv_caches=kv_caches,
        attn_backend=attn_backend,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(context_lens),
    )
