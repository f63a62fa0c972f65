"""Latent pages: the part of a block's KV that only a sliding window reads, as a resource of its own.

DeepSeek-V4 (layers/kv_layout.py, ``KVLayout.latent_window``) reads a sequence's compact pages (compressor
checkpoints, compressed entries) over its whole context but its latents only over the last ``window`` positions,
and the latents are most of its bytes a token. So a block holds its compact pages for as long as any sequence or the
prefix cache holds the block, and a latent page only while some running sequence's window covers it: once the
window of a sequence's next token (and of the first query of its next chunk) has passed a block, the sequence lets
go of the block's page (``release``) but keeps the block.

A page a sequence let go of stays with its block where the block is in the prefix cache: another request with the
same prefix then finds the latents its window needs (BlockManager.match_prefix takes a hit only up to a length
whose window's blocks all have pages). Such pages, held by no window, are taken back least recently released first
when the free list runs out (``_new_page``), and with their block when the block is evicted (``forget``).

The block -> page map lives on the device (the last tensor of the pool's list); this class keeps the host copy and
the changes since the step before (``take_updates``), which the runner writes into the device map in place before
the step's forward, on the step's stream: a page another block gave up is written only after every step that read
it through the old block. Page 0 is the dummy page: a block without a page maps to it.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from graphserve.layers.kv_layout import KVLayout

NO_PAGE = 0  # the dummy page: padding rows write there, and no window of a real sequence reads it


class LatentPages:
    def __init__(self, num_pages: int, num_blocks: int, window: int, block_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"latent pages={num_pages}: need at least 2 (page 0 is the dummy page)")
        self.num_pages, self.window, self.block_size = num_pages, window, block_size
        self.page_of = [NO_PAGE] * num_blocks
        self.holders = [0] * num_blocks  # running sequences whose window covers the block
        self.free_pages: list[int] = list(range(num_pages - 1, NO_PAGE, -1))
        # blocks of the prefix cache holding a page no window covers, least recently released first
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.updates: dict[int, int] = {}  # block -> page, since the last take_updates
        self.num_released = 0  # pages given back from behind running sequences' windows, since start

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages a block can be given: never used, or idle in the prefix cache."""
        return len(self.free_pages) + len(self.idle)

    @property
    def num_idle_pages(self) -> int:
        """Pages no window covers, kept with their cached blocks for a prefix hit (taken back first when short)."""
        return len(self.idle)

    @property
    def num_held_pages(self) -> int:
        """Pages the windows of running sequences hold: what a new block cannot take."""
        return self.num_usable_pages - self.num_free_pages

    def first_needed(self, position: int) -> int:
        """The first block the window of a query at ``position`` reads."""
        return max(0, position - self.window + 1) // self.block_size

    def has_page(self, block: int) -> bool:
        return self.page_of[block] != NO_PAGE

    def take_updates(self) -> list[tuple[int, int]]:
        updates = list(self.updates.items())
        self.updates.clear()
        return updates

    def _set(self, block: int, page: int) -> None:
        self.page_of[block] = page
        self.updates[block] = page

    def _new_page(self) -> int:
        if self.free_pages:
            return self.free_pages.pop()
        block, _ = self.idle.popitem(last=False)
        page = self.page_of[block]
        self._set(block, NO_PAGE)
        return page

    def hold_new(self, block: int) -> None:
        """A block a sequence just allocated: give it a page (the caller checked ``num_free_pages``)."""
        assert self.holders[block] == 0 and not self.has_page(block), f"block {block} already holds a latent page"
        self._set(block, self._new_page())
        self.holders[block] = 1

    def hold(self, block: int) -> None:
        """A cached block with a page that a sequence's window now covers (a prefix hit)."""
        assert self.has_page(block), f"block {block}: a window over a block without a latent page"
        if self.holders[block] == 0:
            self.idle.pop(block, None)
        self.holders[block] += 1

    def let_go(self, block: int, cached: bool) -> None:
        """A sequence's window no longer covers ``block``: its page stays with it while ``cached`` (in the prefix
        cache), else goes back to the free list once no window covers it."""
        assert self.holders[block] > 0, f"block {block}: latent page let go of twice"
        self.holders[block] -= 1
        if self.holders[block] == 0:
            if cached:
                self.idle[block] = None
            else:
                self.forget(block)

    def forget(self, block: int) -> None:
        """The block leaves the prefix cache (evicted, or the cache is reset): its idle page, if any, goes back."""
        if self.holders[block] == 0 and self.has_page(block):
            self.idle.pop(block, None)
            self.free_pages.append(self.page_of[block])
            self._set(block, NO_PAGE)

    def check_no_leak(self) -> None:
        held = [b for b, n in enumerate(self.holders) if n]
        assert not held, f"latent pages still held with no live request: blocks {held[:16]}"
        assert self.num_free_pages == self.num_usable_pages, (
            f"free {len(self.free_pages)} + idle {len(self.idle)} latent pages != usable {self.num_usable_pages}"
        )


def latent_page_count(layout: KVLayout, num_blocks: int, block_size: int, max_running: int, chunk: int) -> int | None:
    """The latent pages (the dummy page included) beside ``num_blocks`` blocks (the dummy block included) of a layout
    whose latents are paged apart, as the memory plan splits the pool (engine/memory.py): what ``max_running``
    windows want, never more than one a block; None for any other layout."""
    if layout.latent_window is None:
        return None
    return min(num_blocks, layout.latent_pages_wanted(block_size, max_running, chunk))
