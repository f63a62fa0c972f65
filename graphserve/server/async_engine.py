"""The engine behind the server, fed from the asyncio loop.

The core runs in its own process by default (``separate_process``, see engine_process.py), or on a thread
of the server process. Either way its outputs go to the output thread (output_pump.py), which detokenizes
off the event loop and hands the loop per-request deltas, which it fans out to the streams. In-process,
requests go in through a locked inbox that the engine thread drains between steps (the core is only
touched by that thread: it has no locks), and the thread sleeps on a condition when there is no work.

Requests are keyed in the engine by ids of our own, unique for the server's life: a client's ``rid`` is
only a label, so reusing one can never reach another request's state.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
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
from graphserve.sampling_params import SamplingParams
from graphserve.server.core_driver import FAULT_ENV, CoreDriver
from graphserve.server.deltas import DeltaProcessor, RequestDelta
from graphserve.server.engine_process import (
    AbortRequests,
    AddRequests,
    CoreView,
    EngineChannel,
    EngineLink,
    EngineLoadFailed,
    EngineProcess,
    EngineReady,
    FlushPrefixCache,
    ProfileSteps,
    StepBatch,
)
from graphserve.server.output_pump import OutputPump
from graphserve.server.request_stream import RequestStream
from graphserve.server.step_outputs import StepOutputs

logger = logging.getLogger("graphserve.server")


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, on_step: Callable[[Any], None] | None = None,
                 separate_process: bool = False, stream_interval: int = 1, stream_stall_timeout: float = 30.0,
                 channel: EngineChannel | None = None):
        self.config = config
        self.separate_process = separate_process or channel is not None
        self.channel = channel  # set in a front-end of several (--api-server-count): the engine is not ours
        self.stream_interval = stream_interval
        self.stream_stall_timeout = stream_stall_timeout
        self.core: Any = None  # the EngineCore in-process; a CoreView of the engine process otherwise
        self.input_processor: Any = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.engine_error: str | None = None  # set when the engine process died while serving
        self.stats: Any = None  # last EngineStats, refreshed after every engine iteration
        self.warmup: dict[str, float] = {}
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
        self._process: EngineProcess | EngineLink | None = None
        self._driver: CoreDriver | None = None  # in-process only
        self._pump: OutputPump | None = None
        self._processor: DeltaProcessor | None = None
        self._streams: dict[str, RequestStream] = {}  # engine id -> stream; loop thread only
        self._client_ids: dict[str, str] = {}  # in-flight client rid -> engine id
        self._ids = itertools.count()
        # engine ids are unique over every front-end: each prefixes its serials with its index
        self._id_prefix = "" if channel is None else f"{channel.index}."
        self._all_frontends_ready = channel is None
        self._watchdog: asyncio.Task[None] | None = None
        self._fault_marker = os.environ.get(FAULT_ENV) or None
        self._faulty: set[str] = set()
        self._waiting_in_core = 0  # sequences (in-process engine)
        self._kv_blocks = (0, 1)  # (usable blocks, tokens per block) of the KV pool
        from graphserve.server.profile_route import ProfileBroker

        self.profiles = ProfileBroker(self)  # POST /v1/profile, when the server enables it

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine (its process, or a thread here); ``ready`` is set once it serves."""
        self._loop = loop
        self._watchdog = loop.create_task(self._watch_stalls())
        if self.channel is not None:
            self._process = EngineLink(self.channel, self._on_engine_message, self._on_engine_exit)
            self._process.start()
            return
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
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._process is not None:
            self._process.shutdown(timeout)
        if self._thread is not None:
            self._thread.join(timeout)
        if self._pump is not None:
            self._pump.stop()

    @property
    def alive(self) -> bool:
        """The engine serves: loaded, not dead, not stopped."""
        if not self.ready.is_set() or self.load_error is not None or self.engine_error is not None or self._stopped:
            return False
        return self._process is None or self._process.alive

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
        from graphserve.engine.processor import InputProcessor

        self.input_processor = InputProcessor(core.tokenizer, core.info, self.config, (num_usable_blocks, block_size))
        self._processor = DeltaProcessor(core.tokenizer)
        assert self._loop is not None
        self._pump = OutputPump(self._processor, self._loop, self._deliver, self._send_aborts)
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
        if not self._all_frontends_ready:
            channel = self.channel
            assert channel is not None
            ready = channel.ready.value
            if ready < channel.count:  # the kernel may send the next connection to one still loading
                raise ServiceUnavailableError(f"the HTTP front-ends are still starting ({ready} of {channel.count} "
                                              "ready)", retry_after=1)
            self._all_frontends_ready = True

    def queued_sequences(self) -> int:
        if self._process is not None:  # shared with the engine (and every other front-end): engine_loop.py
            return int(self._process.queued.value)
        return self._waiting_in_core + sum(r.params.n for r in self._inbox)

    def _overloaded(self, queued: int, n: int) -> OverloadedError:
        return OverloadedError(f"{queued} sequences are waiting and this request adds {n}: the bound is "
                               f"--max-queued-requests={self.config.max_queued_requests}", retry_after=1)

    def _reserve(self, n: int) -> None:
        """Count ``n`` sequences into the shared queue bound, or refuse: check and add under one lock, so
        front-ends that race for the last places never pass the bound together."""
        assert self._process is not None
        queued = self._process.queued
        with queued.get_lock():
            if queued.value + n > self.config.max_queued_requests:
                raise self._overloaded(queued.value, n)
            queued.value += n

    def add_request(
        self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float | None = None
    ) -> RequestStream:
        """Validate, tokenize and enqueue; raises BadRequestError / OverloadedError before anything runs."""
        self.check_serving()
        bound = self.config.max_queued_requests
        if params.n > bound:
            raise BadRequestError(f"n={params.n} is invalid: a request of n sequences waits as n, above the queue "
                                  f"bound --max-queued-requests={bound}", param="n")
        queued = self.queued_sequences()
        if queued + params.n > bound:  # before any work on the request; _reserve decides under the lock
            raise self._overloaded(queued, params.n)
        if request_id in self._client_ids:
            raise BadRequestError(f"rid={request_id!r} is invalid: a request with this id is in flight", param="rid")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        engine_id = f"{request_id}#{self._id_prefix}{next(self._ids)}"
        req = self.input_processor.process(engine_id, prompt, params, arrival)
        self._check_n_fits(len(req.prompt_token_ids), req.params)
        text = req.prompt_text if req.prompt_text is not None else (prompt if isinstance(prompt, str) else "")
        faulty = {engine_id} if self._fault_marker is not None and self._fault_marker in text else set()
        if self._process is not None:
            self._reserve(params.n)
        stream = RequestStream(self, request_id, engine_id, len(req.prompt_token_ids), self.stream_interval)
        assert self._processor is not None
        self._processor.add(engine_id, req.prompt_token_ids, req.params)
        self._streams[engine_id] = stream
        self._client_ids[request_id] = engine_id
        if self._process is not None:
            self._process.send(AddRequests([req], faulty, frontend=self._process.frontend))
            return stream
        with self._cond:
            self._faulty |= faulty
            self._inbox.append(req)
            self._cond.notify()
        return stream

    def _check_n_fits(self, num_prompt: int, params: SamplingParams) -> None:
        """All n sequences of a request run together: they must fit the KV pool at once, or it never finishes.
        Siblings share the prompt's full blocks through the prefix cache; each has its own tail and output."""
        if params.n == 1:
            return  # one sequence: InputProcessor checked it
        usable, bs = self._kv_blocks
        shared = num_prompt // bs if self.config.enable_prefix_caching else 0
        own = -(-(num_prompt - shared * bs + params.max_tokens) // bs)
        need = shared + params.n * own
        if need > usable:
            raise BadRequestError(
                f"n={params.n} is invalid: {params.n} sequences of prompt ({num_prompt} tokens) + max_tokens "
                f"({params.max_tokens}) need {need * bs} KV tokens, the pool holds {usable * bs} (lower n or "
                "max_tokens, or raise --num-kv-tokens / --kv-cache-gb)", param="n")

    def abort(self, engine_id: str, error: GraphserveError | None = None) -> None:
        """Stop a request and free its blocks; with ``error`` its consumer raises it."""
        stream = self._forget(engine_id)
        if stream is not None and not stream.finished:
            if error is not None:
                stream.fail(error)
            stream.finished = True
            if self.on_abort is not None:
                self.on_abort(stream.request_id, error)
        self._send_aborts([engine_id])

    def _forget(self, engine_id: str) -> RequestStream | None:
        stream = self._streams.pop(engine_id, None)
        if stream is not None and self._client_ids.get(stream.request_id) == engine_id:
            del self._client_ids[stream.request_id]
        if self._processor is not None:
            self._processor.discard(engine_id)
        return stream

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

    def _deliver(self, deltas: list[RequestDelta], to_abort: list[str], failed: dict[str, str]) -> None:
        """Loop thread: fan the output thread's deltas out to the streams (its stop-string aborts already went)."""
        for rid, message in failed.items():
            self.abort(rid, InternalError(f"engine fault while running request {rid}: {message}"))
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is None:
                continue
            if d.error:
                # An error that names a field is the request's fault (a 400); any other is the engine's.
                self.abort(d.request_id, BadRequestError(d.error, param=d.error_param) if d.error_param
                           else InternalError(f"engine fault while running request: {d.error}"))
                continue
            if d.finished:
                self._forget(d.request_id)
            stream.push(d)

    async def _watch_stalls(self) -> None:
        """Abort streams whose client stopped reading (see request_stream.py), freeing their KV blocks."""
        period = max(0.05, min(1.0, self.stream_stall_timeout / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for engine_id, stream in list(self._streams.items()):
                if stream.stalled(now, self.stream_stall_timeout):
                    logger.warning("request %s: its client has not read for %.1f s (--stream-stall-timeout); "
                                   "aborting it", stream.request_id, now - stream.last_take)
                    self.abort(engine_id, ServiceUnavailableError(
                        f"the client did not read its response for {self.stream_stall_timeout:g} s "
                        "(--stream-stall-timeout)", retry_after=1))

    # -- engine process: reader thread, then loop thread --------------------------------------------------

    def _on_engine_message(self, msg: Any) -> None:
        if isinstance(msg, StepBatch):
            self.stats = msg.stats
            if self._pump is not None:  # tokens first: the output thread detokenizes while the listeners run
                self._pump.push(msg.outputs, msg.failed)
            if msg.records and self.core is not None:
                self.core.telemetry.extend(msg.records)  # listeners (metrics, step log) run here, off the loop
        elif isinstance(msg, EngineReady):
            try:
                from graphserve.models.loader import load_tokenizer

                core = CoreView(load_tokenizer(self.config.model), msg.info, msg.chat_template, msg.max_model_len)
                if self._on_step is not None:
                    core.telemetry.add_listener(self._on_step)
                self._serving(core, msg.num_usable_blocks, msg.block_size)
                self.stats = msg.stats
                self.warmup = msg.warmup
                if self.channel is not None:
                    with self.channel.ready.get_lock():
                        self.channel.ready.value += 1
            except Exception as exc:  # noqa: BLE001 - reported to the launcher, which exits non-zero
                logger.exception("loading the tokenizer of %s failed", self.config.model)
                self.load_error = exc
            self.ready.set()
        elif isinstance(msg, ProfileSteps):
            self.profiles.on_result(msg)
        elif isinstance(msg, EngineLoadFailed):
            self.load_error = ModelLoadError(msg.message)
            self.ready.set()

    def _on_engine_exit(self, exitcode: int | None) -> None:
        if not self.ready.is_set():
            self.load_error = ModelLoadError(f"the engine process exited with code {exitcode} while loading")
            self.ready.set()
            return
        code = "" if exitcode is None else f" (exit code {exitcode})"
        self.engine_error = f"the engine process died{code}; restart the server"
        logger.error("%s: failing %d in-flight request(s)", self.engine_error, len(self._streams))
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.abort_all, InternalError(self.engine_error))

    # -- in-process engine thread ------------------------------------------------------------------------

    def _load(self) -> None:
        from graphserve.engine.core import EngineCore
        from graphserve.server.warmup import warm_up

        core = EngineCore(self.config)
        self.warmup = warm_up(core)
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
        reported: set[str] = set()
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
                flat = StepOutputs()
                flat.add_core_outputs(outputs, reported)
                reported.difference_update(failed)
                assert self._pump is not None
                self._pump.push(flat, failed)
