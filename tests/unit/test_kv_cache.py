"""BlockManager: free list, reference counts, prefix cache, LRU eviction, invariants."""

from __future__ import annotations

import pytest

from graphserve.engine.kv_cache import BlockManager
from graphserve.engine.request import Sequence
from graphserve.sampling_params import SamplingParams

BS = 4


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(), seed=0, arrival_time=0.0)


def _run_prefill(bm: BlockManager, seq: Sequence) -> None:
    bm.match_prefix(seq)
    assert bm.allocate_slots(seq, seq.num_pending_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def test_block_zero_is_never_allocated_and_capacity_is_exact():
    bm = BlockManager(num_blocks=5, block_size=BS)
    seq = _seq(list(range(16)))
    assert bm.allocate_slots(seq, 16)
    assert sorted(seq.block_table) == [1, 2, 3, 4]
    assert bm.usage() == 1.0
    other = _seq([1])
    assert not bm.allocate_slots(other, 1)
    assert other.block_table == []  # all or nothing
    bm.free(seq)
    bm.check_no_leak()
    assert bm.usage() == 0.0


def test_allocation_grows_only_at_block_boundaries():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = _seq([1, 2, 3])
    assert bm.allocate_slots(seq, 3) and len(seq.block_table) == 1
    seq.num_computed_tokens = 3
    assert bm.allocate_slots(seq, 1) and len(seq.block_table) == 1
    seq.num_computed_tokens = 4
    assert bm.allocate_slots(seq, 1) and len(seq.block_table) == 2
    bm.free(seq)
    bm.check_no_leak()


def test_prefix_hit_shares_blocks_and_counts_hits():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = _seq(list(range(10)))  # 2 full blocks + 2 tokens
    _run_prefill(bm, a)
    b = _seq(list(range(8)) + [99, 98, 97])
    hit = bm.match_prefix(b)
    assert hit == 8 and b.block_table == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    assert bm.hit_tokens == 8 and bm.queried_tokens == 10 + 11
    # a different first block breaks the chain even when later blocks are equal
    c = _seq([7, 1, 2, 3] + list(range(4, 8)) + [0])
    assert bm.match_prefix(c) == 0
    for s in (a, b, c):
        bm.free(s)
    bm.check_no_leak()


def test_last_token_is_always_computed():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = _seq(list(range(8)))
    _run_prefill(bm, a)
    bm.free(a)
    b = _seq(list(range(8)))
    assert bm.match_prefix(b) == 4  # the second block holds the last token: recomputed
    assert b.num_pending_tokens == 4
    bm.free(b)
    bm.check_no_leak()


def test_unreferenced_cached_blocks_are_evicted_lru_only_when_needed():
    bm = BlockManager(num_blocks=5, block_size=BS)
    a = _seq(list(range(9)))
    _run_prefill(bm, a)  # 3 blocks, 2 of them full and cached
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.evictable) == 2
    b = _seq([50, 51, 52])
    assert bm.allocate_slots(b, 3)  # taken from the free list: cache survives
    assert len(bm.cached) == 2
    c = _seq(list(range(20, 29)))
    assert bm.allocate_slots(c, 9)  # needs 3: 1 free + 2 evicted
    assert not bm.cached and not bm.evictable
    for s in (b, c):
        bm.free(s)
    bm.check_no_leak()


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a = _seq(list(range(12)))
    _run_prefill(bm, a)
    b = _seq(list(range(12)))
    assert bm.match_prefix(b) == 0
    bm.free(a)
    bm.check_no_leak()


def test_invariants_fail_loudly():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = _seq([1, 2, 3, 4, 5])
    assert bm.allocate_slots(seq, 5)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(seq)
    with pytest.raises(ValueError, match="dummy block"):
        BlockManager(num_blocks=1, block_size=BS)
