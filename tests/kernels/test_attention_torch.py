"""The CPU backend's batched decode path computes what the per-sequence reference computes."""

from __future__ import annotations

import pytest
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


def test_contiguous_batch_lays_sequences_on_consecutive_blocks():
    from graphserve.layers.forward_batch import contiguous_batch

    kv = [torch.zeros(2, 16, 4, 2, 8)]
    b = contiguous_batch([5, 1], [5, 6], kv, None, vocab_size=50)
    assert b.mode == "mixed" and b.block_tables.tolist() == [[1, 2], [3, 4]]
    assert b.positions.tolist() == [0, 1, 2, 3, 4, 5]
    assert b.slot_mapping.tolist() == [4, 5, 6, 7, 8, 12 + 4 + 1]  # seq 1's token 5 sits in its 2nd block
    assert b.logits_indices.tolist() == [4, 5] and b.seq_lens.tolist() == [5, 6]
    assert contiguous_batch([1, 1], [3, 9], kv, None, 50).mode == "decode"
    with pytest.raises(ValueError, match="needs 17 blocks"):
        contiguous_batch([64], [64], kv, None, 50)
