"""Latent pages (engine/latent_pages.py): DeepSeek-V4's latents held only for running sequences' windows, while the
blocks (their compact pages) stay. The block manager and scheduler on their own: pages freed as the window slides,
admission refusing when pages lack, prefix hits truncated to what their window still finds, idle pages of cached
blocks evicted least recently released first, and no page leaked once every request ends; and the memory plan's
split of the pool between the windows' pages and the blocks."""

from __future__ import annotations

import pytest
import torch
from model_utils import schedule_and_sample

from graphserve import SamplingParams
from graphserve.config import EngineConfig
from graphserve.engine.kv_cache import BlockManager
from graphserve.engine.latent_pages import NO_PAGE, latent_page_count
from graphserve.engine.memory import plan_memory
from graphserve.engine.request import Sequence
from graphserve.engine.scheduler import Scheduler
from graphserve.kernels.paged_kv import DUMMY_BLOCK
from graphserve.layers.forward_batch import contiguous_batch
from graphserve.layers.kv_layout import CompactCache, KVLayout

BS, WINDOW = 4, 8


def _manager(num_blocks: int = 64, pages: int = 16, prefix: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BS, prefix, latent_pages=pages, latent_window=WINDOW)


def _scheduler(bm: BlockManager, chunk: int = 8) -> Scheduler:
    return Scheduler(EngineConfig(block_size=BS, chunked_prefill_size=chunk), bm)


def _seq(rid: str, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(rid, 0, prompt, SamplingParams(max_tokens=max_tokens), seed=0, arrival_time=float(len(rid)))


_step = schedule_and_sample


def _held(bm: BlockManager, seq: Sequence) -> list[int]:
    """The blocks of ``seq`` with a latent page."""
    return [b for b in seq.block_table if bm.pages.has_page(b)]


def _map_agrees(bm: BlockManager, device_map: list[int]) -> None:
    """The updates taken so far, applied to ``device_map``, give the host's map."""
    for block, page in bm.pages.take_updates():
        device_map[block] = page
    assert device_map == bm.pages.page_of


def test_pages_go_back_as_the_window_slides_and_the_blocks_stay():
    bm = _manager()
    s = _scheduler(bm)
    device_map = [NO_PAGE] * bm.num_blocks
    a = _seq("a", list(range(1, 21)), max_tokens=30)
    s.add(a)
    for _ in range(3):  # 20 prompt tokens in chunks of 8
        _step(s)
        _map_agrees(bm, device_map)
    assert a.num_computed_tokens == 20 and DUMMY_BLOCK not in a.block_table
    for _ in range(20):
        c = a.num_computed_tokens
        _step(s)
        _map_agrees(bm, device_map)
        first = max(0, c - WINDOW + 1) // BS  # the window of the step's token at position c
        assert all(bm.pages.has_page(b) for b in a.block_table[first:])
        # behind the window: no sequence holds the page; it idles with its cached block, for a prefix hit, and
        # counts as free
        released = a.block_table[:a.num_released_blocks]
        assert released and all(bm.pages.holders[b] == 0 and b in bm.pages.idle for b in released)
        held = [b for b in a.block_table if bm.pages.holders[b]]
        assert bm.pages.num_free_pages == bm.pages.num_usable_pages - len(held)
        assert len(held) <= WINDOW // BS + 1
        # every block, the released ones included, is still the sequence's (its compact pages)
        assert DUMMY_BLOCK not in a.block_table and all(bm.ref_counts[b] == 1 for b in a.block_table)
    pages = {bm.pages.page_of[b] for b in _held(bm, a)}
    assert len(pages) == len(_held(bm, a)) and NO_PAGE not in pages  # distinct, real pages
    assert bm.pages.num_released > 0
    while s.num_unfinished:
        _step(s)
    bm.check_no_leak()  # every block free or cached, every page free or idle with a cached block


def test_admission_waits_for_pages_while_blocks_and_budget_are_there():
    """4 usable pages: a running request holds 3 (its window of 8 across block edges, and its next block), so a
    second one whose first chunk needs 3 waits, with blocks and prefill budget to spare, until the first ends."""
    bm = _manager(num_blocks=64, pages=5, prefix=False)
    s = _scheduler(bm, chunk=16)
    a, b = _seq("a", list(range(1, 21)), 12), _seq("bb", list(range(30, 50)), 4)
    s.add(a)
    s.add(b)
    free_before = bm.pages.num_free_pages
    page_bound = 0
    while s.num_unfinished:
        out = _step(s)
        assert sum(len(_held(bm, q)) for q in (a, b)) <= 4
        if b.status.name == "WAITING" and a.status.name == "RUNNING" and out.num_prefill_tokens == 0:
            page_bound += 1
            assert bm.num_free_blocks > 50 and bm.pages.num_free_pages < 3
    assert page_bound >= 5 and a.finish_reason == b.finish_reason == "length" and not (a.error or b.error)
    assert bm.pages.num_free_pages == free_before
    bm.check_no_leak()


def test_a_running_request_short_of_a_page_preempts_the_newest():
    """7 usable pages: prompts of 8, 8 and 12 tokens take 2 + 2 + 3 in one step; the next tokens of the first two
    cross into new blocks, so the newest is preempted (its pages freed), recomputed later, and all finish."""
    bm = _manager(num_blocks=64, pages=8, prefix=False)
    s = _scheduler(bm, chunk=32)
    seqs = [_seq(rid, list(range(1 + 20 * i, 1 + 20 * i + n)), 6) for i, (rid, n) in enumerate(
        (("a", 8), ("bb", 8), ("ccc", 12)))]  # fmt: skip
    for seq in seqs:
        s.add(seq)
    _step(s)
    assert bm.pages.num_free_pages == 0 and all(q.status.name == "RUNNING" for q in seqs)
    out = _step(s)
    assert out.preempted == [seqs[2]] and seqs[2].block_table == [] and s.num_preemptions == 1
    # the reason the step and the scheduler keep: pages, with blocks to spare
    assert out.preempted_for_pages == s.num_preemptions_for_pages == 1 and bm.short_of == "latent pages"
    assert bm.page_counts() == (6, 0, 7) and bm.num_free_blocks > 50
    assert [len(_held(bm, q)) for q in seqs[:2]] == [3, 3]
    while s.num_unfinished:
        _step(s)
    assert all(q.finish_reason == "length" for q in seqs)
    bm.check_no_leak()


def test_allocation_is_refused_whole_when_pages_lack():
    bm = _manager(num_blocks=64, pages=3)  # 2 usable pages
    seq = _seq("a", list(range(1, 13)))
    assert not bm.allocate_slots(seq, 12)  # 3 blocks, each needing a page
    assert seq.block_table == [] and bm.pages.num_free_pages == 2 and bm.num_free_blocks == 63
    assert bm.allocate_slots(seq, 8)
    bm.free(seq)
    bm.check_no_leak()


def test_a_prefix_hit_reaches_only_as_far_as_its_window_finds_pages():
    bm = _manager(num_blocks=64, pages=16)
    s = _scheduler(bm, chunk=64)
    prompt = list(range(1, 41))  # 10 blocks
    a = _seq("a", prompt, max_tokens=1)
    s.add(a)
    while s.num_unfinished:
        _step(s)
    # one chunk, then finished: its cached blocks keep the pages they had when it let go of them
    cached = [bm.cached[h] for h in list(bm.cached)]
    with_page = [blk for blk in cached if bm.pages.has_page(blk)]
    assert len(cached) == 10 and len(with_page) == 10  # nothing pressed for pages: every one idles with its page
    # a request sharing 36 tokens hits 36 (9 blocks) while its window's pages are there
    b = _seq("b", prompt[:36] + [99, 98], max_tokens=1)
    assert bm.match_prefix(b) == 36 and b.num_released_blocks == (36 - WINDOW + 1) // BS
    assert all(bm.pages.holders[blk] == 1 for blk in b.block_table[b.num_released_blocks:])
    bm.free(b)
    # take block 8's page away (as eviction would): the hit falls back to the longest prefix whose window has pages
    eighth = bm.cached[list(bm.cached)[8]]
    bm.pages.forget(eighth)
    c = _seq("c", prompt[:36] + [99, 98], max_tokens=1)
    hit = bm.match_prefix(c)
    assert hit == 32  # 8 blocks: the window of position 32 (25..32) reads blocks 6 and 7, which have pages
    assert eighth not in c.block_table and all(bm.pages.has_page(blk) for blk in c.block_table[c.num_released_blocks:])
    bm.free(c)
    # every page gone: only a hit whose window reads no block at all remains, the empty one
    for blk in cached:
        bm.pages.forget(blk)
    d = _seq("d", prompt[:36] + [99, 98], max_tokens=1)
    assert bm.match_prefix(d) == 0 and d.block_table == []
    bm.check_no_leak()


def test_idle_pages_of_cached_blocks_are_evicted_least_recently_released_first():
    bm = _manager(num_blocks=64, pages=9)  # 8 usable pages
    s = _scheduler(bm, chunk=64)
    first_blocks = []
    for seq in (_seq("a", list(range(1, 17)), 1), _seq("bb", list(range(100, 116)), 1)):
        s.add(seq)  # 4 blocks each, one after the other: 8 idle pages
        while s.num_unfinished:
            _step(s)
        first_blocks = first_blocks or list(bm.pages.idle)
    assert len(bm.pages.idle) == 8 and not bm.pages.free_pages
    order = list(bm.pages.idle)
    assert order[:4] == first_blocks  # the first request's, its tail first (released first on its end)
    third = _seq("ccc", list(range(200, 212)), 1)  # 3 blocks: takes the 3 least recently released pages
    assert bm.allocate_slots(third, 12)
    assert [blk for blk in order if not bm.pages.has_page(blk)] == order[:3]
    assert all(bm.pages.has_page(blk) for blk in third.block_table)
    # the blocks whose pages went stay cached: a hit over them just no longer reaches past them
    assert all(blk in bm.block_hash for blk in order[:3])
    bm.free(third)
    bm.check_no_leak()
    # a reset of the prefix cache frees every idle page with its blocks
    bm.reset_prefix_cache()
    assert not bm.pages.idle and len(bm.pages.free_pages) == 8
    bm.check_no_leak()


def test_the_plan_gives_the_windows_their_pages_and_the_blocks_the_rest():
    """1000 B a token, 800 of them latent: 11 pages of 4 tokens come first (35,200 B), the blocks get the rest at
    200 B a token; a pool too small for more blocks than pages gives every block its page instead."""
    kw = dict(mem_fraction_static=1.0, weights_bytes=0, activation_bytes=0, graph_pool_bytes=0, reserve_bytes=0,
              kv_bytes_per_token=1000, block_size=BS, max_running_requests=2, latent_bytes_per_token=800,
              latent_pages=11, latent_window=WINDOW, kv_parts=(("latent", 800), ("compressed entries", 200)))
    plan = plan_memory(10**6, max_model_len=64, **kw)
    assert plan.latent_pages == 11 and plan.latent_pool_bytes == 11 * BS * 800 and plan.block_bytes_per_token == 200
    assert plan.kv_tokens == (10**6 - 35200) // 200 // BS * BS == 4824 and plan.fits
    table = plan.table()
    assert "latent pages" in table and "200 B/token for the whole context" in table
    small = plan_memory(40000, max_model_len=16, **kw)  # 6 blocks after the pages: fewer than the pages
    assert small.latent_pages == 0 and small.kv_tokens == 40000 // 1000 // BS * BS and small.fits
    # a request longer than the blocks hold is refused, its tokens priced at the blocks' bytes
    long = plan_memory(10**6, max_model_len=8000, **kw)
    assert not long.fits and f"{8000 * 200 / 2**30:.2f} GiB" in long.refusal


def test_the_pages_wanted_cover_every_running_window_and_a_chunk_twice():
    layout = KVLayout("latent", 2, 1, 16, torch.bfloat16, latent_window=WINDOW)
    # per running sequence: ceil(7 / 4) + 2 = 4 pages; the chunk of 16 another 4; twice that, and the dummy page
    assert layout.latent_pages_wanted(BS, 3, 16) == 2 * (3 * 4 + 4) + 1
    assert layout.latent_pages_needed(BS, 16) == 7 and layout.latent_pages_needed(BS) == 3
    assert layout.latent_bytes_per_token == 2 * 16 * 2 and layout.latent_map_index == 2
    assert latent_page_count(layout, 1000, BS, 3, 16) == 33 and latent_page_count(layout, 20, BS, 3, 16) == 20
    assert latent_page_count(KVLayout("latent", 2, 1, 16, torch.bfloat16), 1000, BS, 3, 16) is None


def test_a_synthetic_batch_is_sized_by_the_blocks_and_the_pages_given_not_by_the_latents_tensor():
    """The latents tensor has the pages, not the blocks: a synthetic batch takes both counts from its caller, fits
    the blocks (compact pages, the map) whatever the pages, and never needs more pages than the pool has."""
    layout = KVLayout("latent", 2, 1, 16, torch.float32, compact=(CompactCache(4, 8, 16),), row_dtype=torch.float32,
                      block_size=BS, latent_window=WINDOW)
    caches = layout.allocate(8, BS, "cpu", latent_pages=20)  # more pages than blocks: the latents tensor says 20
    assert caches[0].shape[0] == 20 and caches[layout.latent_map_index].shape[0] == 8
    with pytest.raises(ValueError, match="needs 11 blocks, the pool has 8"):
        contiguous_batch([1] * 10, [1] * 10, caches, None, 50, num_blocks=8, latent_pages=20)
    batch = contiguous_batch([1] * 7, [1] * 7, caches, None, 50, num_blocks=8, latent_pages=20)
    assert batch.block_tables.flatten().tolist() == list(range(1, 8))
    # fewer pages than blocks: a decode batch of more rows than usable pages is refused, naming the pages
    caches = layout.allocate(64, BS, "cpu", latent_pages=6)
    with pytest.raises(ValueError, match="needs 6 latent pages .* has 5 besides the dummy page"):
        contiguous_batch([1] * 6, [1] * 6, caches, None, 50, num_blocks=64, latent_pages=6)
    batch = contiguous_batch([1, 3], [1, 9], caches, None, 50, num_blocks=64, latent_pages=6)  # 1 + 3 blocks
    assert batch.block_tables.tolist() == [[1, DUMMY_BLOCK, DUMMY_BLOCK], [2, 3, 4]]
    # the pages without the blocks: refused, the latents tensor being no block count
    with pytest.raises(ValueError, match="needs the pool's num_blocks"):
        contiguous_batch([1], [1], caches, None, 50, latent_pages=6)


def test_a_preemption_for_blocks_is_not_counted_for_pages():
    """Pages to spare, 6 usable blocks: two prompts of 12 tokens take 3 blocks each, the first one's next token
    needs a fourth, and the newest is preempted for a block."""
    bm = _manager(num_blocks=7, pages=40, prefix=False)
    s = _scheduler(bm, chunk=32)
    a, b = _seq("a", list(range(1, 13)), 6), _seq("bb", list(range(20, 32)), 6)
    s.add(a)
    s.add(b)
    _step(s)
    out = _step(s)
    assert out.preempted == [b] and bm.short_of == "blocks"
    assert out.preempted_for_pages == s.num_preemptions_for_pages == 0 and s.num_preemptions == 1
    used, idle, total = bm.page_counts()
    assert used == len(_held(bm, a)) > 0 and (idle, total) == (0, 39)
    while s.num_unfinished:
        _step(s)
    bm.check_no_leak()
    assert BlockManager(8, BS).page_counts() == (0, 0, 0)  # no latent pages: nothing to count
