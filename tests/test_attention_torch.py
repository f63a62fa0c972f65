"""The CPU backend's batched decode path computes what the per-sequence reference computes."""

from __future__ import annotations

import torch

from graphserve.layers.attention import batched_decode_attention, reference_paged_attention


def test_batched_decode_matches_reference_on_random_inputs():
    gen = torch.Generator().manual_seed(11)
    num_blocks, block_size, heads, kv_heads, dim = 40, 4, 8, 2, 16
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    seq_lens = [1, 7, 13, 4, 16]
    width = max(-(-n // block_size) for n in seq_lens)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)  # padding -> dummy block 0
    for i, n in enumerate(seq_lens):
        for j in range(-(-n // block_size)):
            tables[i, j] = order.pop()
    q = torch.randn(len(seq_lens), heads, dim, generator=gen)
    got = batched_decode_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens), 0.25)
    want = reference_paged_attention(q, k_cache, v_cache, tables, [1] * len(seq_lens), seq_lens, 0.25)
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < 1e-5
