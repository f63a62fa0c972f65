"""Grammar compilation off the step path: a cache of compiled grammars keyed by the constraint, filled by
a thread pool, and the per-sequence matcher that follows a sequence's output tokens.

The engine submits a constrained request's grammar when the request arrives and keeps the request out
of the scheduler until the compile is done, so a new schema never stalls the steps of other requests
(xgrammar compiles in C++ without holding the GIL). A compile that is still running after
``timeout_s`` fails its request with a bad-request error; the compile itself runs on and lands in
the cache, so a later request with the same schema is served.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from graphserve.structured.constraint import to_grammar

if TYPE_CHECKING:
    from graphserve.structured.constraint import StructuredOutput

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 30.0  # a grammar still compiling after this fails its request (400)
CACHE_ENTRIES = 512  # compiled grammars kept (least recently used dropped first)
COMPILE_WORKERS = 2  # grammars compiled at once; each compile also uses xgrammar's own threads


class GrammarState:
    """One sequence's position in its grammar: advanced by every output token, asked for the next mask."""

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the output ends here."""
        return bool(self.matcher.is_terminated())


class GrammarCompiler:
    """``tokenizer`` / ``vocab_size`` / ``stop_token_ids``: the engine's; the TokenizerInfo (about a
    second for a 150k vocabulary) is built on the first compile, in the pool, never at start-up."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 timeout_s: float = COMPILE_TIMEOUT_S, workers: int = COMPILE_WORKERS):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="graphserve-grammar")
        self._lock = threading.Lock()  # guards the cache (engine thread and pool threads)
        self._init_lock = threading.Lock()  # guards the one-time TokenizerInfo build (held for ~1 s)
        self._compiler: Any = None
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = collections.OrderedDict()
        self.num_compiles = 0
        self.compile_seconds = 0.0

    def submit(self, c: StructuredOutput) -> concurrent.futures.Future:
        """The compiled grammar of ``c``, from the cache or a compile queued now."""
        with self._lock:
            fut = self._cache.get(c.key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(c.key)
                return fut
            fut = self._pool.submit(self._compile, c)
            self._cache[c.key] = fut
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return fut

    def matcher(self, compiled: Any) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids))

    def _xgr_compiler(self) -> Any:
        import xgrammar as xgr

        with self._init_lock:
            if self._compiler is None:
                start = time.perf_counter()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                threads = max(1, min(8, os.cpu_count() or 1))
                self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
                logger.info("grammar compiler ready: vocab %d, %.0f ms", self.vocab_size,
                            (time.perf_counter() - start) * 1e3)
            return self._compiler

    def _compile(self, c: StructuredOutput) -> Any:
        compiler = self._xgr_compiler()
        start = time.perf_counter()
        compiled = compiler.compile_grammar(to_grammar(c))  # the grammar the edge checked, corrections included
        elapsed = time.perf_counter() - start
        with self._lock:  # two pool threads may finish at once
            self.num_compiles += 1
            self.compile_seconds += elapsed
        logger.debug("compiled %s grammar (%d chars) in %.1f ms", c.kind, len(c.spec), elapsed * 1e3)
        return compiled
