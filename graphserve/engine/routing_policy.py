"""Which replica serves a request: the one holding the longest cached prefix of it, else the least loaded.

No HTTP here: the same policy serves separate `graphserve serve` workers behind `graphserve router` (router/app.py
feeds it their /v1/cache_events) and engine replicas inside one server, fed with their block pools' events
directly. A replica's index holds exactly the block hashes its own cache events say it holds: stored and not yet
removed. Prompts are hashed with the block pool's own chain hash, so a hit here is a hit there, up to the events
still in flight.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from graphserve.engine.kv_cache import CLEARED, REMOVED, ROOT_HASH, STORED, chain_hash

# Requests in flight. A guess, not a measurement: past it a busier holder's queue is taken to cost more than
# recomputing the prefix elsewhere (`graphserve router --balance-threshold` sets it).
DEFAULT_BALANCE_THRESHOLD = 32


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chain hashes of the blocks of a prompt the engine could serve from its cache: full blocks before its
    last token, whose logits are always computed (BlockManager.match_prefix)."""
    out: list[int] = []
    parent = ROOT_HASH
    for i in range((len(token_ids) - 1) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


class PrefixIndex:
    """One replica's cached block hashes, as its cache events tell them, and the tokens per block it hashes."""

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        self.hashes: set[int] = set()

    def __len__(self) -> int:
        return len(self.hashes)

    def reset(self, hashes: Iterable[int] = (), block_size: int | None = None) -> None:
        """Start again from a snapshot of every hash the replica caches."""
        self.hashes = set(hashes)
        if block_size is not None:
            self.block_size = block_size

    def apply(self, events: Iterable[Sequence]) -> None:
        """Events as engine/kv_cache.py logs them: (stored, hash, parent), (removed, hash), (cleared,)."""
        for ev in events:
            kind = ev[0]
            if kind == STORED:
                self.hashes.add(ev[1])
            elif kind == REMOVED:
                self.hashes.discard(ev[1])
            elif kind == CLEARED:
                self.hashes.clear()
            else:
                raise ValueError(f"cache event {list(ev)!r}: unknown kind {kind!r} (known: {STORED}, {REMOVED}, "
                                 f"{CLEARED})")

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` cached here. A hash chains over its whole prefix, so the walk stops at the
        first miss: a later block held without its parent is never served by the engine either."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n


@dataclass(frozen=True)
class Choice:
    replica: Hashable
    hit_blocks: int  # leading prompt blocks the replica holds (summed over the prompts of a batched request)
    by_prefix: bool  # chosen for its cached prefix; False: by load alone (no replica held any block)


class RoutingPolicy:
    """Prefix indexes of the replicas, and the choice among those that can serve now."""

    def __init__(self, replicas: Iterable[Hashable] = (), block_size: int = 16,
                 balance_threshold: int | None = DEFAULT_BALANCE_THRESHOLD):
        self.indexes: dict[Hashable, PrefixIndex] = {r: PrefixIndex(block_size) for r in replicas}
        # A prefix every request shares (a system prompt) would otherwise send all of them to its first holder
        # while the others idle: past this many requests in flight more than the least loaded, load decides.
        if balance_threshold is not None and balance_threshold < 0:
            raise ValueError(f"balance_threshold={balance_threshold} is invalid: must be >= 0 (or None: never)")
        self.balance_threshold = balance_threshold
        self._turn = 0  # breaks load ties in turn, so equal replicas share an idle start

    def add(self, replica: Hashable, block_size: int = 16) -> None:
        self.indexes.setdefault(replica, PrefixIndex(block_size))

    def reset(self, replica: Hashable, hashes: Iterable[int] = (), block_size: int | None = None) -> None:
        self.indexes[replica].reset(hashes, block_size)

    def apply(self, replica: Hashable, events: Iterable[Sequence]) -> None:
        self.indexes[replica].apply(events)

    def hits(self, prompts: Sequence[Sequence[int]], replicas: Iterable[Hashable]) -> dict[Hashable, int]:
        """Leading cached blocks of ``prompts`` (token ids, summed over them) on each replica."""
        hashed: dict[int, list[list[int]]] = {}  # block size -> each prompt's hashes
        out: dict[Hashable, int] = {}
        for r in replicas:
            index = self.indexes.get(r)
            if index is None or not index.hashes:
                out[r] = 0
                continue
            if index.block_size not in hashed:
                hashed[index.block_size] = [block_hashes(p, index.block_size) for p in prompts]
            out[r] = sum(index.match(h) for h in hashed[index.block_size])
        return out

    def choose(self, prompts: Sequence[Sequence[int]], available: Sequence[Hashable],
               load: dict[Hashable, int]) -> Choice:
        """``prompts``: the request's prompts as token ids (empty when they are unknown); ``available``: the
        replicas that can serve now, in a fixed order; ``load``: each one's requests in flight. The longest
        cached prefix wins, unless its holders are all more than ``balance_threshold`` requests busier than
        the least loaded; ties and no hit go to the least loaded, then in turn."""
        if not available:
            raise ValueError("no replica is available to choose from")
        hits = self.hits(prompts, available)
        best = max(hits.values())
        if best and self.balance_threshold is not None:
            floor = min(load.get(r, 0) for r in available)
            if min(load.get(r, 0) for r in available if hits[r] == best) > floor + self.balance_threshold:
                hits = dict.fromkeys(available, 0)
                best = 0
        tied = [r for r in available if hits[r] == best]
        least = min(load.get(r, 0) for r in tied)
        tied = [r for r in tied if load.get(r, 0) == least]
        replica = tied[self._turn % len(tied)]
        self._turn += 1
        return Choice(replica, best, best > 0)
