"""The engine on its own thread, fed from the asyncio loop.

Requests go in through a locked inbox that the engine thread drains between steps; core outputs come back
to the loop with ``call_soon_threadsafe``, where the OutputProcessor detokenizes. Tokenization and
detokenization stay on the loop thread so a step is never delayed by string work, and the core is only
ever touched by its own thread (it has no locks). With no work the thread sleeps on a condition.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from graphserve.config import EngineConfig
from graphserve.errors import BadRequestError, GraphserveError, InternalError, OverloadedError, ServiceUnavailableError
from graphserve.outputs import RequestOutput
from graphserve.sampling_params import SamplingParams

logger = logging.getLogger("graphserve.server")

# Test-only: a request whose prompt contains this marker makes the next engine step raise.
FAULT_ENV = "GRAPHSERVE_FAULT_INJECT"


class InjectedFault(RuntimeError):
    def __init__(self, request_ids: set[str]):
        super().__init__(f"injected engine fault for {sorted(request_ids)}")
        self.request_ids = set(request_ids)


class RequestStream:
    """The outputs of one request, as the loop receives them; iterate with ``async for``."""

    def __init__(self, engine: AsyncEngine, request_id: str, prompt_token_ids: list[int]):
        self.engine = engine
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.queue: asyncio.Queue[RequestOutput | GraphserveError] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self.queue.get()
                # Outputs are cumulative, so a consumer that fell behind (a busy loop, a slow client) takes only
                # the newest: under load chunks grow instead of the loop re-sending every step's output.
                while not isinstance(item, GraphserveError) and not item.finished and not self.queue.empty():
                    item = self.queue.get_nowait()
                if isinstance(item, GraphserveError):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not self.finished:  # the consumer left early (client gone, task cancelled): free the blocks
                self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, on_step: Callable[[Any], None] | None = None):
        self.config = config
        self.core: Any = None
        self.input_processor: Any = None
        self.output_processor: Any = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.stats: Any = None  # last EngineStats, refreshed by the engine thread
        self._on_step = on_step
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._inbox: list[Any] = []  # EngineRequests to add
        self._aborts: list[str] = []
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._in_core: set[str] = set()  # engine thread only
        self._fault_marker = os.environ.get(FAULT_ENV) or None
        self._faulty: set[str] = set()
        self._waiting_in_core = 0

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Load the model and run the step loop on a background thread; ``ready`` is set once it serves."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="graphserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds (0 before the model is loaded)."""
        blocks = getattr(self.core, "block_manager", None) if self.core is not None else None
        if blocks is None:
            return 0
        return int(blocks.num_usable_blocks * blocks.block_size)

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    # -- loop-thread API ---------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float | None = None
    ) -> RequestStream:
        """Validate, tokenize and enqueue; raises BadRequestError / OverloadedError before anything runs."""
        if not self.ready.is_set():
            raise ServiceUnavailableError("the engine is still loading the model", retry_after=5)
        if self.load_error is not None:
            raise ServiceUnavailableError(f"the engine failed to load: {self.load_error}", retry_after=60)
        if self._stopped:
            raise ServiceUnavailableError("the engine is shutting down", retry_after=5)
        queued = self._waiting_in_core + len(self._inbox)
        if queued >= self.config.max_queued_requests:
            raise OverloadedError(
                f"{queued} requests are waiting, the bound is --max-queued-requests={self.config.max_queued_requests}",
                retry_after=1,
            )
        if request_id in self._streams:
            raise BadRequestError(f"rid={request_id!r} is invalid: a request with this id is in flight", param="rid")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        req = self.input_processor.process(request_id, prompt, params, arrival)
        self._check_fits(req)
        stream = RequestStream(self, request_id, list(req.prompt_token_ids))
        self.output_processor.add(req)
        self._streams[request_id] = stream
        text = req.prompt_text if req.prompt_text is not None else (prompt if isinstance(prompt, str) else "")
        faulty = self._fault_marker is not None and self._fault_marker in text
        with self._cond:
            if faulty:
                self._faulty.add(request_id)
            self._inbox.append(req)
            self._cond.notify()
        return stream

    def _check_fits(self, req: Any) -> None:
        # The core checks this too, but on its thread, after a stream's 200 has gone out; checked here the
        # client gets a plain 400. The pool's size and block size never change, so reading them is safe.
        blocks = self.core.block_manager
        total = len(req.prompt_token_ids) + (req.params.max_tokens or 0)
        if blocks.blocks_needed(total) > blocks.num_usable_blocks:
            capacity = blocks.num_usable_blocks * blocks.block_size
            raise BadRequestError(
                f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({req.params.max_tokens}) = {total} tokens "
                f"does not fit the KV pool of {capacity} tokens (raise it with --num-kv-tokens or --kv-cache-gb)",
                param="max_tokens",
            )

    async def generate(
        self, prompt: Any, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        async for out in self.add_request(request_id, prompt, params):
            yield out

    def abort(self, request_id: str, error: GraphserveError | None = None) -> None:
        """Stop a request and free its blocks; with ``error`` its consumer raises it."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            stream.finished = True
            if error is not None:
                stream.queue.put_nowait(error)
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def abort_all(self, error: GraphserveError) -> int:
        ids = list(self._streams)
        for rid in ids:
            self.abort(rid, error)
        return len(ids)

    def _deliver(self, core_outputs: list[Any], failed: dict[str, str]) -> None:
        """Loop thread: detokenize, fan out to streams, and send stop-string finishes back to the core."""
        for rid, message in failed.items():
            self.abort(rid, InternalError(f"engine fault while running request {rid}: {message}"))
        if not core_outputs:
            return
        try:
            request_outputs, ids_to_abort = self.output_processor.process(core_outputs)
        except Exception as exc:  # noqa: BLE001 - detokenization broke: fail these requests, never leave them hanging
            logger.exception("output processing failed")
            for rid in {co.request_id for co in core_outputs}:
                self.abort(rid, InternalError(f"output processing failed: {type(exc).__name__}: {exc}"))
            return
        for out in request_outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.error:
                self.abort(out.request_id, InternalError(f"engine fault while running request: {out.error}"))
                continue
            if out.finished:
                stream.finished = True
                del self._streams[out.request_id]
            stream.queue.put_nowait(out)
        if ids_to_abort:
            with self._cond:
                self._aborts.extend(ids_to_abort)
                self._cond.notify()

    # -- engine thread -----------------------------------------------------------------------------------

    def _load(self) -> None:
        from graphserve.engine.core import EngineCore
        from graphserve.engine.processor import InputProcessor, OutputProcessor

        self.core = EngineCore(self.config)
        self.input_processor = InputProcessor(self.core.tokenizer, self.core.info, self.config)
        self.output_processor = OutputProcessor(self.core.tokenizer)
        if self._on_step is not None:
            self.core.telemetry.add_listener(self._on_step)
        self.stats = self.core.stats()

    def _run(self) -> None:
        try:
            self._load()
        except BaseException as exc:  # noqa: BLE001 - reported to the launcher, which exits non-zero
            self.load_error = exc
            logger.exception("engine failed to load %s", self.config.model)
            self.ready.set()
            return
        self.ready.set()
        while True:
            with self._cond:
                while not (self._stopped or self._inbox or self._aborts or self.core.has_unfinished_requests()):
                    self._cond.wait()
                if self._stopped:
                    return
                new, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                faulty = set(self._faulty)
            outputs: list[Any] = []
            try:
                outputs, failed = self._iteration(new, aborts, faulty)
            except Exception as exc:  # noqa: BLE001 - outside a step: fail what the core holds, keep the thread
                failed = self._fail(exc)
                failed.update({r.request_id: f"{type(exc).__name__}: {exc}" for r in new})
            if outputs or failed:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._deliver, outputs, failed)

    def _iteration(self, new: list[Any], aborts: list[str], faulty: set[str]) -> tuple[list[Any], dict[str, str]]:
        """Admit new requests, apply aborts, run one step; returns (core outputs, failed id -> reason)."""
        failed: dict[str, str] = {}
        for req in new:
            try:
                self.core.add_request(req)
                self._in_core.add(req.request_id)
            except GraphserveError as exc:
                failed[req.request_id] = exc.message
        if aborts:
            self.core.abort_requests(aborts)
            self._in_core.difference_update(aborts)
        outputs: list[Any] = []
        if self.core.has_unfinished_requests():
            try:
                outputs = self._step(faulty)
            except Exception as exc:  # noqa: BLE001 - fail the affected requests, keep serving the rest
                failed.update(self._fail(exc))
        self.stats = self.core.stats()
        self._waiting_in_core = int(self.stats.waiting)
        return outputs, failed

    def _step(self, faulty: set[str]) -> list[Any]:
        hit = faulty & self._in_core
        if hit:
            raise InjectedFault(hit)
        outputs = self.core.step()
        for out in outputs:
            if out.finish_reason is not None:
                self._in_core.discard(out.request_id)
        return outputs

    def _fail(self, exc: Exception) -> dict[str, str]:
        # A fault that names its requests fails only those; any other fault fails what the core held,
        # since its state for them is unknown. Aborting frees their blocks so the pool stays whole.
        ids = set(getattr(exc, "request_ids", ())) or set(self._in_core)
        logger.error("engine step failed (%s: %s); failing %d request(s)", type(exc).__name__, exc, len(ids),
                     exc_info=not isinstance(exc, InjectedFault))
        with self._cond:
            self._faulty.difference_update(ids)
        try:
            self.core.abort_requests(list(ids))
        except Exception:  # noqa: BLE001
            logger.exception("abort after an engine fault failed")
        self._in_core.difference_update(ids)
        return {rid: f"{type(exc).__name__}: {exc}" for rid in ids}
