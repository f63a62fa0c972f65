"""The engine behind the server, fed from the asyncio loop.

The core runs in its own process by default (``separate_process``, see engine_process.py), or on a thread
of the server process. Either way tokenization and detokenization stay on the loop thread, so a step is
never delayed by string work, and core outputs come back to the loop with ``call_soon_threadsafe``, where
the OutputProcessor detokenizes. In-process, requests go in through a locked inbox that the engine thread
drains between steps (the core is only touched by that thread: it has no locks), and the thread sleeps on
a condition when there is no work.
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
from graphserve.errors import (
    BadRequestError,
    GraphserveError,
    InternalError,
    ModelLoadError,
    OverloadedError,
    ServiceUnavailableError,
)
from graphserve.outputs import RequestOutput
from graphserve.sampling_params import SamplingParams
from graphserve.server.core_driver import FAULT_ENV, CoreDriver
from graphserve.server.engine_process import (
    AbortRequests,
    AddRequests,
    CoreView,
    EngineLoadFailed,
    EngineProcess,
    EngineReady,
    FlushPrefixCache,
    ProfileSteps,
    StepBatch,
)

logger = logging.getLogger("graphserve.server")


class RequestStream:
    """The outputs of one request, as the loop receives them; iterate with ``async for``."""

    def __init__(self, engine: AsyncEngine, request_id: str, num_prompt_tokens: int):
        self.engine = engine
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
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
    def __init__(self, config: EngineConfig, *, on_step: Callable[[Any], None] | None = None,
                 separate_process: bool = False):
        self.config = config
        self.separate_process = separate_process
        self.core: Any = None  # the EngineCore in-process; a CoreView of the engine process otherwise
        self.input_processor: Any = None
        self.output_processor: Any = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.engine_error: str | None = None  # set when the engine process died while serving
        self.stats: Any = None  # last EngineStats, refreshed after every engine iteration
        self._on_step = on_step
        # Called on the loop as on_abort(request_id, error) for a request stopped before it finished.
        self.on_abort: Callable[[str, GraphserveError | None], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._inbox: list[Any] = []  # in-process: EngineRequests to add
        self._aborts: list[str] = []
        self._flush_cache = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._process: EngineProcess | None = None
        self._driver: CoreDriver | None = None  # in-process only
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._fault_marker = os.environ.get(FAULT_ENV) or None
        self._faulty: set[str] = set()
        self._waiting_in_core = 0
        self._unadmitted = 0  # engine process: requests sent that no batch has acknowledged yet
        self._kv_blocks = (0, 1)  # (usable blocks, tokens per block) of the KV pool
        from graphserve.server.profile_route import ProfileBroker

        self.profiles = ProfileBroker(self)  # POST /v1/profile, when the server enables it

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine (its process, or a thread here); ``ready`` is set once it serves."""
        self._loop = loop
        if self.separate_process:
            self._process = EngineProcess(self.config, self._on_engine_message, self._on_engine_exit)
            self._process.start()
            return
        self._thread = threading.Thread(target=self._run, name="graphserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._process is not None:
            self._process.shutdown(timeout)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds (0 before the model is loaded)."""
        return self._kv_blocks[0] * self._kv_blocks[1]

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    def _serving(self, core: Any, num_usable_blocks: int, block_size: int) -> None:
        from graphserve.engine.processor import InputProcessor, OutputProcessor

        self.input_processor = InputProcessor(core.tokenizer, core.info, self.config, (num_usable_blocks, block_size))
        self.output_processor = OutputProcessor(core.tokenizer)
        self._kv_blocks = (num_usable_blocks, block_size)
        self.core = core

    # -- loop-thread API ---------------------------------------------------------------------------------

    def check_serving(self) -> None:
        """Raise ServiceUnavailableError unless the engine can take requests now."""
        if self.load_error is not None:
            raise ServiceUnavailableError(f"the engine failed to load: {self.load_error}", retry_after=60)
        if not self.ready.is_set():
            raise ServiceUnavailableError("the engine is still loading the model", retry_after=5)
        if self.engine_error is not None:
            raise ServiceUnavailableError(self.engine_error, retry_after=60)
        if self._stopped:
            raise ServiceUnavailableError("the engine is shutting down", retry_after=5)

    def add_request(
        self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float | None = None
    ) -> RequestStream:
        """Validate, tokenize and enqueue; raises BadRequestError / OverloadedError before anything runs."""
        self.check_serving()
        queued = self._waiting_in_core + len(self._inbox) + self._unadmitted
        if queued >= self.config.max_queued_requests:
            raise OverloadedError(
                f"{queued} requests are waiting, the bound is --max-queued-requests={self.config.max_queued_requests}",
                retry_after=1,
            )
        if request_id in self._streams:
            raise BadRequestError(f"rid={request_id!r} is invalid: a request with this id is in flight", param="rid")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        req = self.input_processor.process(request_id, prompt, params, arrival)
        stream = RequestStream(self, request_id, len(req.prompt_token_ids))
        self.output_processor.add(req)
        self._streams[request_id] = stream
        text = req.prompt_text if req.prompt_text is not None else (prompt if isinstance(prompt, str) else "")
        faulty = {request_id} if self._fault_marker is not None and self._fault_marker in text else set()
        if self._process is not None:
            self._unadmitted += 1
            self._process.send(AddRequests([req], faulty))
            return stream
        with self._cond:
            self._faulty |= faulty
            self._inbox.append(req)
            self._cond.notify()
        return stream

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
            if self.on_abort is not None:
                self.on_abort(request_id, error)
        self._send_aborts([request_id])

    def _send_aborts(self, ids: list[str]) -> None:
        if self._process is not None:
            self._process.send(AbortRequests(ids))
            return
        with self._cond:
            self._aborts.extend(ids)
            self._cond.notify()

    def flush_prefix_cache(self) -> None:
        """Drop the prefix cache before the engine's next step; requests added after this call see it empty."""
        if self._process is not None:
            self._process.send(FlushPrefixCache())
            return
        with self._cond:
            self._flush_cache = True
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
                self.abort(out.request_id, BadRequestError(out.error, param=out.error_param) if out.error_param
                           else InternalError(f"engine fault while running request: {out.error}"))
                continue
            if out.finished:
                stream.finished = True
                del self._streams[out.request_id]
            stream.queue.put_nowait(out)
        if ids_to_abort:
            self._send_aborts(list(ids_to_abort))

    # -- engine process: reader thread, then loop thread --------------------------------------------------

    def _on_engine_message(self, msg: Any) -> None:
        if isinstance(msg, StepBatch):
            if msg.records and self.core is not None:
                self.core.telemetry.extend(msg.records)  # listeners (metrics, step log) run here, off the loop
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._on_batch, msg)
        elif isinstance(msg, EngineReady):
            try:
                from graphserve.models.loader import load_tokenizer

                core = CoreView(load_tokenizer(self.config.model), msg.info, msg.chat_template, msg.max_model_len)
                if self._on_step is not None:
                    core.telemetry.add_listener(self._on_step)
                self._serving(core, msg.num_usable_blocks, msg.block_size)
                self.stats = msg.stats
            except Exception as exc:  # noqa: BLE001 - reported to the launcher, which exits non-zero
                logger.exception("loading the tokenizer of %s failed", self.config.model)
                self.load_error = exc
            self.ready.set()
        elif isinstance(msg, ProfileSteps):
            self.profiles.on_result(msg)
        elif isinstance(msg, EngineLoadFailed):
            self.load_error = ModelLoadError(msg.message)
            self.ready.set()

    def _on_batch(self, batch: StepBatch) -> None:
        self.stats = batch.stats
        self._waiting_in_core = int(batch.stats.waiting)
        self._unadmitted = max(0, self._unadmitted - batch.admitted)
        if batch.outputs or batch.failed:
            self._deliver(batch.outputs, batch.failed)

    def _on_engine_exit(self, exitcode: int | None) -> None:
        if not self.ready.is_set():
            self.load_error = ModelLoadError(f"the engine process exited with code {exitcode} while loading")
            self.ready.set()
            return
        self.engine_error = f"the engine process died (exit code {exitcode}); restart the server"
        logger.error("%s: failing %d in-flight request(s)", self.engine_error, len(self._streams))
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.abort_all, InternalError(self.engine_error))

    # -- in-process engine thread ------------------------------------------------------------------------

    def _load(self) -> None:
        from graphserve.engine.core import EngineCore

        core = EngineCore(self.config)
        self._driver = CoreDriver(core)
        self._serving(core, core.block_manager.num_usable_blocks, core.block_manager.block_size)
        if self._on_step is not None:
            core.telemetry.add_listener(self._on_step)
        self.stats = core.stats()

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
                while not (self._stopped or self._inbox or self._aborts or self._flush_cache
                           or self._driver.has_work()):
                    self._cond.wait()
                if self._stopped:
                    return
                flush, self._flush_cache = self._flush_cache, False
                new, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                faulty, self._faulty = self._faulty, set()
            if flush:
                self._driver.flush_prefix_cache()
            outputs, failed = self._driver.iterate(new, aborts, faulty)
            self.stats = self._driver.core.stats()
            self._waiting_in_core = int(self.stats.waiting)
            if outputs or failed:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._deliver, outputs, failed)
