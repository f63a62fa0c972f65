"""Block tables for kernel tests: each sequence's blocks drawn from a shuffled pool, so the block-table indirection is
really exercised, and never the dummy block 0 (layers/forward_batch.py), which padding entries point at."""

from __future__ import annotations

import torch


def shuffled_tables(seq_lens: list[int], page: int, gen: torch.Generator, spare_blocks: int = 2,
                    extra_cols: int = 1) -> tuple[int, torch.Tensor]:  # fmt: skip
    """(the pool's block count, int32 block tables on the CPU): ``ceil(n / page)`` shuffled blocks a sequence out of
    a pool of their sum plus ``spare_blocks`` (block 0 among them), and ``extra_cols`` zero columns past the longest
    sequence, as a padded table has."""
    per_seq = [-(-n // page) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).int()
    tables = torch.zeros(len(seq_lens), max(per_seq) + extra_cols, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = order[used : used + nb]
        used += nb
    return num_blocks, tables


def token_slots(tables: torch.Tensor, seq_lens: list[int], page: int) -> list[torch.Tensor]:
    """Each sequence's cache slots (block * page + offset) for its positions 0..n-1."""
    return [tables[i, torch.arange(n) // page].long() * page + torch.arange(n) % page for i, n in enumerate(seq_lens)]
