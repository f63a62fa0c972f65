"""The engine's prefix-cache events, for a router in front of several servers (the route: server/app.py).

The engine's block pool logs every block hash that enters or leaves its prefix cache (engine/kv_cache.py); those
events reach this server with the step outputs and land in a ``CacheEventLog``. A router long-polls
``/v1/cache_events?since=N``: the answer holds the events after serial N as soon as there are any (or none when
``timeout`` passes), and ``next``, the serial to ask from next time.

Long-polling rather than a stream or headers on responses: a router that restarts, loses a connection or falls
behind the bounded log asks again from where it stood and gets the events it missed, or, when they are gone, a
snapshot of every cached hash (the log keeps the set of cached hashes as the events change it). ``epoch`` is new
with every server start, so a router notices a restarted worker, whose serials start over, and takes a snapshot.
A response piggy-backed on completions would only tell a router about the requests it sent itself, and never
about evictions that happen later.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import uuid
from typing import Any

from graphserve.engine.kv_cache import CLEARED, REMOVED, ROOT_HASH, STORED, chain_hash

MAX_EVENTS = 32_768  # kept for routers that fall behind (a few MB); one further back gets a snapshot instead
MAX_WAIT_S = 60.0
# A fixed block's hash: a router whose Python hashes tuples otherwise cannot match this worker's hashes.
HASH_PROBE = chain_hash(ROOT_HASH, (1, 2, 3))


class CacheEventLog:
    """The engine's cache events with serials, and the set of hashes cached now. Filled from the thread that
    receives the engine's outputs; read on the event loop."""

    def __init__(self, max_events: int = MAX_EVENTS):
        self.epoch = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._events: collections.deque[tuple[int, tuple]] = collections.deque(maxlen=max_events)
        self._next = 1  # serial of the next event: 0 is the empty log's, so a snapshot's `next` is >= 0
        self.cached: set[int] = set()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def extend(self, events: list[tuple]) -> None:
        if not events:
            return
        with self._lock:
            for ev in events:
                kind = ev[0]
                if kind == STORED:
                    self.cached.add(ev[1])
                elif kind == REMOVED:
                    self.cached.discard(ev[1])
                elif kind == CLEARED:
                    self.cached.clear()
                self._events.append((self._next, ev))
                self._next += 1
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def read(self, since: int) -> dict[str, Any]:
        """The events with serial > ``since``; a snapshot of the cached hashes instead when ``since`` is -1, in
        the future (another epoch) or older than the oldest event kept."""
        with self._lock:
            last = self._next - 1
            oldest = self._events[0][0] if self._events else self._next
            if since == last and since >= 0:
                return {"events": [], "next": last}
            if since < 0 or since > last or since + 1 < oldest:
                return {"snapshot": sorted(self.cached), "events": [], "next": last}
            events = [list(ev) for _, ev in itertools.islice(self._events, since + 1 - oldest, None)]
            return {"events": events, "next": last}

    async def wait(self, since: int, timeout: float) -> dict[str, Any]:
        """``read(since)``, after waiting up to ``timeout`` s for an event past ``since`` when there is none."""
        out = self.read(since)
        if out["events"] or "snapshot" in out or timeout <= 0:
            return out
        event = asyncio.Event()
        with self._lock:
            if self._next - 1 > since:
                return self.read(since)
            self._waiters.append((asyncio.get_running_loop(), event))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            with self._lock:
                self._waiters = [w for w in self._waiters if w[1] is not event]
        return self.read(since)
