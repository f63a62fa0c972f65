"""The KV block pool: free list, reference counts and the prefix cache.

Block 0 is the dummy block (see forward_batch.py) and is never handed out. A full block whose KV
is computed gets a hash that chains over every token before it, ``hash((parent_hash, tokens))``,
so equal hashes mean equal prefixes. Cached blocks nobody references stay in an LRU list and are
reused (evicted) only when the free list is empty, so a later request with the same prefix can
pick them up for free.

With ``window`` (a model whose every layer attends through a sliding window of that many tokens, the largest of
its windows), a running sequence's blocks that lie wholly before the window of its next token go back to the pool
(``release_outside_window``). Its block table keeps their positions, the entries pointing at the dummy block, so a
position still finds its block by index and the attention kernels, which start at the window's first block, never
read them. A released block in the prefix cache stays there, unreferenced, for another request with the same
prefix, as any freed block does; the sequence itself never matches it again (it matches only at admission, and a
preempted sequence starts over from an empty table).

With ``latent_pages`` (DeepSeek-V4: latents only a sliding window reads, beside compact pages read over the whole
context), a block's latent page is a resource of its own (engine/latent_pages.py): a running sequence holds the
pages of the blocks its window covers and lets go of the others as the window slides, keeping the blocks. A prefix
hit is taken only up to a length whose window's blocks still have their pages.

Cache events (``record_events``): every hash that enters the prefix cache ("stored") or leaves it ("removed",
"cleared") is logged for whoever drains ``take_events``, so a router in front of several engines keeps each one's
prefix index from the engine's own changes (engine/routing_policy.py hashes prompts with ``chain_hash``).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from graphserve.engine.latent_pages import LatentPages
from graphserve.kernels.paged_kv import DUMMY_BLOCK

if TYPE_CHECKING:
    from graphserve.engine.request import Sequence

_ROOT_HASH = 0x5EED
ROOT_HASH = _ROOT_HASH

# Events, as plain tuples (pickled to the server, JSON to a router): (STORED, hash, parent hash),
# (REMOVED, hash), (CLEARED,).
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


def chain_hash(parent: int, tokens: list[int] | tuple[int, ...]) -> int:
    """The hash of a full block given its parent's: equal hashes mean equal prefixes. Python's hash of a tuple
    of ints does not depend on PYTHONHASHSEED, so every process of one Python version agrees on it."""
    return hash((parent, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, latent_pages: int | None = None,
                 latent_window: int | None = None):  # fmt: skip
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (block 0 is the reserved dummy block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        if window is not None and window < 1:
            raise ValueError(f"window={window}: a sliding window holds at least 1 token")
        self.window = window
        self.num_released = 0  # blocks given back from outside running sequences' windows, since start
        self.ref_counts = [0] * num_blocks
        # Pop from the end: lower block ids are handed out first (easier to read in logs).
        self.free_blocks: list[int] = list(range(num_blocks - 1, DUMMY_BLOCK, -1))
        self.block_hash: dict[int, int] = {}  # block id -> hash, for blocks in the prefix cache
        self.block_tokens: dict[int, tuple[int, ...]] = {}  # guards against hash collisions
        self.cached: dict[int, int] = {}  # hash -> block id
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.events: list[tuple] | None = None  # cache events since the last take_events; None: not recorded
        self.pages: LatentPages | None = None
        # what the last refused allocate_slots lacked: "blocks" or "latent pages" (the preemption it causes says so)
        self.short_of: str | None = None
        if latent_pages is not None:
            if latent_window is None or latent_window < 1 or window is not None:
                raise ValueError(f"latent pages need a latent window >= 1 (got {latent_window}) and no block window "
                                 f"(got {window})")  # fmt: skip
            self.pages = LatentPages(latent_pages, num_blocks, latent_window, block_size)

    @property
    def slides(self) -> bool:
        """Whether a running sequence gives something back as its window slides (``release_outside_window``)."""
        return self.window is not None or self.pages is not None

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: never used, or cached but unreferenced."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def page_counts(self) -> tuple[int, int, int]:
        """Latent pages (held by running windows, idle with cached prefixes, usable); zeros without them."""
        pages = self.pages
        if pages is None:
            return 0, 0, 0
        return pages.num_held_pages, pages.num_idle_pages, pages.num_usable_pages

    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------
    def _chain(self, parent: int, tokens: list[int] | tuple[int, ...]) -> int:
        return chain_hash(parent, tokens)

    def record_events(self) -> None:
        """Log cache events from now on, starting with a "stored" event for every hash already cached (the
        warm-up's), so a reader that applies every event knows exactly what is cached."""
        if self.events is None:
            self.events = [(STORED, h, None) for h in self.cached]

    def take_events(self) -> list[tuple]:
        """The events since the previous call (none when not recorded)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    def match_prefix(self, seq: Sequence) -> int:
        """At admission: take the cached blocks matching the sequence's leading full blocks.

        The last token is never served from the cache: its logits are needed to sample. Returns
        the number of tokens hit (also stored as ``seq.num_computed_tokens``).
        """
        assert not seq.block_table, f"{seq}: prefix match on a sequence that already holds blocks"
        self.queried_tokens += seq.num_prompt_tokens
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent = _ROOT_HASH
        found: list[tuple[int, int]] = []
        for i in range(max_blocks):
            tokens = tuple(seq.tokens_slice(i * self.block_size, (i + 1) * self.block_size))
            h = self._chain(parent, tokens)
            block = self.cached.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            found.append((block, h))
            parent = h
        pages = self.pages
        if pages is not None:  # the next query's window must find its latents: a shorter hit where pages are gone
            while found and not all(pages.has_page(b) for b, _ in found[pages.first_needed(len(found) * self.block_size):]):
                found.pop()
            seq.num_released_blocks = pages.first_needed(len(found) * self.block_size)
        for i, (block, h) in enumerate(found):
            self._take(block)
            if pages is not None and i >= seq.num_released_blocks:
                pages.hold(block)
            seq.block_table.append(block)
            seq.block_hashes.append(h)
        hit = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = hit
        self.hit_tokens += min(hit, seq.num_prompt_tokens)
        return hit

    def commit(self, seq: Sequence) -> None:
        """After a step: put the sequence's newly full, computed blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else _ROOT_HASH
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.tokens_slice(i * self.block_size, (i + 1) * self.block_size))
            h = self._chain(parent, tokens)
            block = seq.block_table[i]
            seq.block_hashes.append(h)
            parent = h
            if block == DUMMY_BLOCK:  # released before it was committed: nothing left to cache
                continue
            if h not in self.cached and block not in self.block_hash:
                self.cached[h] = block
                self.block_hash[block] = h
                self.block_tokens[block] = tokens
                if self.events is not None:
                    self.events.append((STORED, h, seq.block_hashes[-2] if i else _ROOT_HASH))
            # else: another sequence computed the same prefix first; keep its block as the cached one

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (SGLang's /flush_cache); returns the cached blocks dropped.

        Blocks that no sequence holds go back to the free list; blocks that running sequences hold stay theirs
        but are no longer matched, and are freed as plain blocks when those sequences end.
        """
        dropped = len(self.block_hash)
        if self.pages is not None:
            for block in list(self.pages.idle):
                self.pages.forget(block)
        self.free_blocks.extend(self.evictable)
        self.evictable.clear()
        self.block_hash.clear()
        self.block_tokens.clear()
        self.cached.clear()
        if self.events is not None:
            self.events.append((CLEARED,))
        return dropped

    # ---- allocation -------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.evictable.pop(block, None)
        self.ref_counts[block] += 1

    def _new_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            h = self.block_hash.pop(block)
            del self.cached[h]
            del self.block_tokens[block]
            if self.pages is not None:
                self.pages.forget(block)
            if self.events is not None:
                self.events.append((REMOVED, h))
        assert self.ref_counts[block] == 0, f"block {block} handed out while referenced ({self.ref_counts[block]})"
        self.ref_counts[block] = 1
        return block

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make the block table cover ``num_computed_tokens + num_new_tokens`` tokens.

        All or nothing: returns False, having allocated nothing, when the pool is short.
        """
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            self.short_of = "blocks"
            return False
        pages = self.pages
        if pages is not None:
            self.release_outside_window(seq)  # the pages behind the chunk's first query go back before new ones
            if needed > pages.num_free_pages:
                self.short_of = "latent pages"
                return False
        for _ in range(needed):
            block = self._new_block()
            assert block not in seq.block_table, f"{seq}: block {block} allocated twice to one sequence"
            seq.block_table.append(block)
            if pages is not None:
                pages.hold_new(block)
        return True

    def _drop(self, seq: Sequence, block: int) -> None:
        assert self.ref_counts[block] > 0, f"{seq}: block {block} freed twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.block_hash:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (finish, abort or preemption)."""
        # Tail blocks first into the LRU: they are the least likely to be shared, so evict them first.
        if self.pages is not None:
            for block in reversed(seq.block_table[seq.num_released_blocks:]):
                self.pages.let_go(block, block in self.block_hash)
        for block in reversed(seq.block_table):
            if block != DUMMY_BLOCK:  # released already (outside the window)
                self._drop(seq, block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.num_released_blocks = 0

    def release_outside_window(self, seq: Sequence) -> int:
        """Give back the blocks of ``seq`` that lie wholly before the window of its next token (position
        ``num_computed_tokens``, which sees positions > num_computed_tokens - window): every later token's window
        starts later still. Their table entries point at the dummy block from then on; the table is a new list,
        so the runner's copy of it is refreshed (engine/seq_rows.py). Returns the blocks released.

        With latent pages the blocks stay and only their latent pages are let go of (the table is unchanged);
        returns the pages let go of."""
        if self.pages is not None:
            return self._release_pages(seq)
        if self.window is None:
            return 0
        first_kept = min((seq.num_computed_tokens - self.window + 1) // self.block_size, len(seq.block_table))
        done = seq.num_released_blocks
        if first_kept <= done:
            return 0
        table = list(seq.block_table)
        # later blocks first into the LRU, as ``free`` puts them: the front of a prefix, most likely shared, goes last
        for i in range(first_kept - 1, done - 1, -1):
            if table[i] != DUMMY_BLOCK:
                self._drop(seq, table[i])
            table[i] = DUMMY_BLOCK
        seq.block_table = table
        seq.num_released_blocks = first_kept
        self.num_released += first_kept - done
        return first_kept - done

    def _release_pages(self, seq: Sequence) -> int:
        pages = self.pages
        first_kept = min(pages.first_needed(seq.num_computed_tokens), len(seq.block_table))
        done = seq.num_released_blocks
        if first_kept <= done:
            return 0
        for i in range(first_kept - 1, done - 1, -1):  # the front of a prefix, most likely shared, idles longest
            block = seq.block_table[i]
            pages.let_go(block, block in self.block_hash)
        seq.num_released_blocks = first_kept
        pages.num_released += first_kept - done
        return first_kept - done

    def check_no_leak(self) -> None:
        """Every block is free or only held by the prefix cache (call when no request is live)."""
        held = [b for b in range(1, self.num_blocks) if self.ref_counts[b] != 0]
        assert not held, f"blocks still referenced with no live request: {held[:16]}"
        assert self.num_free_blocks == self.num_usable_blocks, (
            f"free {len(self.free_blocks)} + cached {len(self.evictable)} != usable {self.num_usable_blocks}"
        )
        if self.pages is not None:
            self.pages.check_no_leak()
