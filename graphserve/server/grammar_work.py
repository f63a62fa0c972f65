"""A request's grammar work (schema walk, xgrammar's check) kept off the event loop, and bounded per client.

A request's sampling params are first built on the loop with grammar building forbidden: when every spec it
carries was checked before (the common case: clients resend one schema), that is all, and costs a dict
lookup. A spec that was never checked raises GrammarMiss; the request then waits for whoever checks that spec
now, or builds its params again on a small pool of threads (xgrammar releases the GIL while it builds). A
400-level schema once held the loop for 5.4 s, and twenty 200-level ones made /health time out.

Each client (its API key, else its address) may have at most ``per_client`` requests whose grammar is
being built; past that it gets a 429, so one client cannot fill the pool that every client's new schemas
wait on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import threading
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request

from graphserve.errors import OverloadedError
from graphserve.structured.constraint import (
    LIMITS,
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_CHARS,
    GrammarLimits,
    GrammarMiss,
    release,
)

T = TypeVar("T")
WORKERS = 2  # grammars checked at once; each holds a core while xgrammar runs
MAX_GRAMMAR_BUILDS_PER_CLIENT = 4


def client_key(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return "key:" + auth[7:].strip()
    return "addr:" + (request.client.host if request.client is not None else "-")


class GrammarWork:
    def __init__(self, max_depth: int = MAX_SCHEMA_DEPTH, max_chars: int = MAX_SPEC_CHARS,
                 per_client: int = MAX_GRAMMAR_BUILDS_PER_CLIENT):
        self.on_loop = GrammarLimits(max_depth, max_chars, build_here=False)
        self.on_pool = GrammarLimits(max_depth, max_chars, build_here=True)
        self.per_client = per_client
        self._pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="graphserve-schema")
        self._builds: dict[str, int] = {}
        self._lock = threading.Lock()

    async def run(self, request: Request, build: Callable[[], T]) -> T:
        """``build()`` (a request's sampling params), on the loop if its grammars were all checked before."""
        while True:
            try:
                return _with_limits(self.on_loop, build)
            except GrammarMiss as miss:
                if miss.claimed is not None:
                    claim = miss
                    break
                # another request checks this spec now: wait for it without taking a worker
                await asyncio.wait([asyncio.wrap_future(miss.building)])
        client = client_key(request)
        with self._lock:
            n = self._builds.get(client, 0)
            if n >= self.per_client:
                release(claim.claimed, claim.building)
                raise OverloadedError(f"{n} requests of this client have grammars being built, the bound is "
                                      f"--max-grammar-builds-per-client={self.per_client}", param="response_format")
            self._builds[client] = n + 1
        try:
            limits = dataclasses.replace(self.on_pool, claimed=frozenset({claim.claimed}))
            return await asyncio.get_running_loop().run_in_executor(self._pool, _with_limits, limits, build)
        finally:
            release(claim.claimed, claim.building)  # a no-op unless the build stopped before this spec
            with self._lock:
                left = self._builds[client] - 1
                if left:
                    self._builds[client] = left
                else:
                    del self._builds[client]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _with_limits(limits: GrammarLimits, build: Callable[[], T]) -> T:
    ctx = contextvars.copy_context()
    ctx.run(LIMITS.set, limits)
    return ctx.run(build)

