"""One request's outputs on the loop: deltas merge while nobody reads them.

The output thread hands each request its deltas (new text, ids, logprobs); a stream keeps at most one
pending delta, merging later ones into it, so a consumer that falls behind takes several tokens in one
event and what a stream holds grows linearly with its unread output, never with copies of it. A consumer
that has not taken anything for ``stall_timeout`` seconds while output waits (a client that stopped
reading: its socket buffer is full and the response writer is blocked) is aborted by the engine's
watchdog, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

from graphserve.engine.output_processor import RequestDelta
from graphserve.errors import GraphserveError


class StreamOwner(Protocol):
    """What a stream calls on the front-end that made it (server/frontend.Frontend), declared here so that the
    stream does not import the front-end back."""

    def abort(self, engine_id: str, error: GraphserveError | None = None) -> None: ...


class RequestStream:
    """Iterate with ``async for`` to get RequestDeltas; the last one has ``finished`` set."""

    def __init__(self, engine: StreamOwner, request_id: str, engine_id: str, num_prompt_tokens: int,
                 stream_interval: int = 1):
        self.engine = engine
        self.request_id = request_id  # what the client sees (its rid, or ours)
        self.engine_id = engine_id  # the engine's key: unique even when a client reuses a rid
        self.num_prompt_tokens = num_prompt_tokens
        self.stream_interval = stream_interval
        self.finished = False  # the engine side is done (finished, failed or aborted)
        self.last_take = time.monotonic()
        self._pending: RequestDelta | None = None
        self._error: GraphserveError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._done = False  # the consumer has seen the end

    def stalled(self, now: float, timeout: float) -> bool:
        """Output waits and the consumer has been away from it (not waiting for more) for ``timeout`` s."""
        return self._pending is not None and self._waiter is None and now - self.last_take > timeout

    def _ready(self) -> bool:
        p = self._pending
        return p is not None and (p.finished or p.error is not None or self.stream_interval <= 1
                                  or p.num_tokens >= self.stream_interval or p.num_tokens == 0)

    def push(self, delta: RequestDelta) -> None:
        """Loop thread: add a delta; the consumer wakes when ``stream_interval`` tokens wait, or at the end."""
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.merge(delta)
        if delta.finished:
            self.finished = True
        if self._ready():
            self._wake()

    def fail(self, error: GraphserveError) -> None:
        """Loop thread: end the stream with ``error``; unread output is dropped."""
        self.finished = True
        self._pending = None
        self._error = error
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next(self) -> RequestDelta | None:
        """The next (merged) delta; None after the last one. Raises the stream's error."""
        while True:
            if self._error is not None:
                err, self._error = self._error, None
                self._done = True
                raise err
            if self._ready():
                d, self._pending = self._pending, None
                self.last_take = time.monotonic()
                if d.finished:
                    self._done = True
                return d
            if self._done:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
                self.last_take = time.monotonic()

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestDelta]:
        try:
            while True:
                d = await self.next()
                if d is None:
                    return
                yield d
                if d.finished:
                    return
        finally:
            if not self.finished:  # the consumer left early (client gone, task cancelled): free the blocks
                self.engine.abort(self.engine_id)
