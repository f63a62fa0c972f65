"""The engine behind the server, fed from the asyncio loop.

The engine runs behind an ``EngineClient`` (engine/client.py): in its own process by default
(``separate_process``, engine/process_client.py), or on a thread of the server process
(engine/thread_client.py). What it sends back is applied in engine_events.py; its outputs go to the output
thread (output_pump.py), which detokenizes off the event loop and hands the loop per-request deltas, which it
fans out to the streams. This class is the loop's side: it validates, admits and aborts requests, bounds the
queue, and watches for clients that stopped reading.

Requests are keyed in the engine by ids of our own, unique for the server's life: a client's ``rid`` is
only a label, so reusing one can never reach another request's state.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from graphserve import env
from graphserve.config import EngineConfig
from graphserve.engine.client import EngineClient
from graphserve.engine.core_driver import FAULT_ENV, CoreDriver
from graphserve.engine.input_processor import InputProcessor
from graphserve.engine.messages import CoreView
from graphserve.engine.output_processor import OutputProcessor, RequestDelta
from graphserve.engine.process_client import EngineChannel, ProcessClient
from graphserve.engine.request import EngineRequest
from graphserve.engine.telemetry import EngineStats
from graphserve.engine.thread_client import ThreadClient
from graphserve.errors import (
    BadRequestError,
    GraphserveError,
    InternalError,
    OverloadedError,
    ServiceUnavailableError,
)
from graphserve.sampling_params import SamplingParams
from graphserve.server.cache_events import CacheEventLog
from graphserve.server.engine_events import EngineEvents
from graphserve.server.output_pump import OutputPump
from graphserve.server.request_stream import RequestStream
from graphserve.structured.tool_calls import ToolChoice

logger = logging.getLogger("graphserve.server")


class Frontend:
    def __init__(self, config: EngineConfig, *, on_step: Callable[[Any], None] | None = None,
                 separate_process: bool = False, stream_interval: int = 1, stream_stall_timeout: float = 30.0,
                 channel: EngineChannel | None = None, replica: int | None = None,
                 on_cache_events: Callable[[list[tuple]], None] | None = None):
        self.config = config
        # one of the --dp replicas (server/replicas.py): its errors and log lines name it
        self.replica = replica
        self.on_cache_events = on_cache_events  # set by a ReplicaSet: it keeps the replicas' cache events
        self.separate_process = separate_process or channel is not None
        self.channel = channel  # set in a front-end of several (--api-server-count): the engine is not ours
        self.stream_interval = stream_interval
        self.stream_stall_timeout = stream_stall_timeout
        self.core: CoreView | None = None  # what the front-end keeps of the engine, once it serves
        self.input_processor: InputProcessor | None = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.engine_error: str | None = None  # set when the engine process died while serving
        self.stats: EngineStats | None = None  # refreshed after every engine iteration
        self.warmup: dict[str, float] = {}
        self._on_step = on_step
        # Called on the loop as on_abort(request_id, error) for a request stopped before it finished.
        self.on_abort: Callable[[str, GraphserveError | None], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        events = EngineEvents(self)
        self.client: EngineClient
        if self.separate_process:
            self.client = ProcessClient(config, events.on_message, events.on_exit, channel=channel)
        else:
            self.client = ThreadClient(config, events.on_message, events.on_exit)
        self._pump: OutputPump | None = None
        self._processor: OutputProcessor | None = None
        self._streams: dict[str, RequestStream] = {}  # engine id -> stream; loop thread only
        self._client_ids: dict[str, str] = {}  # in-flight client rid -> engine id
        self._ids = itertools.count()
        # engine ids are unique over every front-end: each prefixes its serials with its index
        self._id_prefix = "" if channel is None else f"{channel.index}."
        if replica is not None:  # a ReplicaSet finds a request's replica from its id (replica_of)
            self._id_prefix = f"r{replica}." + self._id_prefix
        self._all_frontends_ready = channel is None
        self._watchdog: asyncio.Task[None] | None = None
        self._fault_marker = env.get(FAULT_ENV) or None
        self._kv_blocks = (0, 1)  # (usable blocks, tokens per block) of the KV pool
        self.cache_events = CacheEventLog()  # the prefix cache's changes, for GET /v1/cache_events
        from graphserve.server.profile_route import ProfileBroker

        self.profiles = ProfileBroker(self)  # POST /v1/profile, when the server enables it

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine (its process, or a thread here); ``ready`` is set once it serves."""
        self._loop = loop
        self._watchdog = loop.create_task(self._watch_stalls())
        self.client.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.client.shutdown(timeout)
        if self._pump is not None:
            self._pump.stop()

    @property
    def alive(self) -> bool:
        """The engine serves: loaded, not dead, not stopped."""
        if not self.ready.is_set() or self.load_error is not None or self.engine_error is not None or self._stopped:
            return False
        return self.client.alive

    @property
    def tokenizer(self) -> Any:
        assert self.core is not None
        return self.core.tokenizer

    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds (0 before the model is loaded)."""
        return self._kv_blocks[0] * self._kv_blocks[1]

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    @property
    def _driver(self) -> CoreDriver | None:
        """The in-process engine's driver, once loaded (tests reach the core through it)."""
        return self.client.driver if isinstance(self.client, ThreadClient) else None

    def _serving(self, core: CoreView, num_usable_blocks: int, block_size: int) -> None:
        self.input_processor = InputProcessor(core.tokenizer, core.info, self.config, (num_usable_blocks, block_size))
        self._processor = OutputProcessor(core.tokenizer)
        assert self._loop is not None
        self._pump = OutputPump(self._processor, self._loop, self._deliver)
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
        """Sequences sent and not scheduled yet, over every front-end (serve_loop.py keeps the count)."""
        return int(self.client.queued.value)

    def _overloaded(self, queued: int, n: int) -> OverloadedError:
        return OverloadedError(f"{queued} sequences are waiting and this request adds {n}: the bound is "
                               f"--max-queued-requests={self.config.max_queued_requests}", retry_after=1)

    def _reserve(self, n: int) -> None:
        """Count ``n`` sequences into the shared queue bound, or refuse: check and add under one lock, so
        front-ends that race for the last places never pass the bound together."""
        queued = self.client.queued
        with queued.get_lock():
            if queued.value + n > self.config.max_queued_requests:
                raise self._overloaded(queued.value, n)
            queued.value += n

    def add_request(
        self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float | None = None,
        tools: ToolChoice | None = None,
    ) -> RequestStream:
        """Validate, tokenize and enqueue; raises BadRequestError / OverloadedError before anything runs.
        ``tools``: a chat stream with tools, whose deltas carry their tool-call pieces (OutputProcessor.add)."""
        self.admit(request_id, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        assert self.input_processor is not None
        req = self.input_processor.process(self.next_engine_id(request_id), prompt, params, arrival)
        return self.submit(req, prompt, request_id, tools)

    def admit(self, request_id: str, params: SamplingParams) -> None:
        """The checks made before any work on a request: serving, the queue bound, the rid not in flight."""
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

    def next_engine_id(self, request_id: str) -> str:
        return f"{request_id}#{self._id_prefix}{next(self._ids)}"

    def submit(self, req: EngineRequest, prompt: Any, request_id: str, tools: ToolChoice | None = None) -> RequestStream:
        """Enqueue a request ``admit`` let in and the input processor made, keyed by an id of ``next_engine_id``."""
        engine_id, params = req.request_id, req.params
        self._check_n_fits(len(req.prompt_token_ids), req.params)
        text = req.prompt_text if req.prompt_text is not None else (prompt if isinstance(prompt, str) else "")
        faulty = {engine_id} if self._fault_marker is not None and self._fault_marker in text else set()
        self._reserve(params.n)
        stream = RequestStream(self, request_id, engine_id, len(req.prompt_token_ids), self.stream_interval)
        assert self._processor is not None
        self._processor.add(engine_id, req.prompt_token_ids, req.params, tools=tools)
        self._streams[engine_id] = stream
        self._client_ids[request_id] = engine_id
        self.client.add([req], faulty)
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
        self.client.abort([engine_id])

    def _forget(self, engine_id: str) -> RequestStream | None:
        stream = self._streams.pop(engine_id, None)
        if stream is not None and self._client_ids.get(stream.request_id) == engine_id:
            del self._client_ids[stream.request_id]
        if self._processor is not None:
            self._processor.discard(engine_id)
        return stream

    def flush_prefix_cache(self) -> None:
        """Drop the prefix cache before the engine's next step; requests added after this call see it empty."""
        self.client.flush_cache()

    def abort_all(self, error: GraphserveError) -> int:
        ids = list(self._streams)
        for rid in ids:
            self.abort(rid, error)
        return len(ids)

    def _deliver(self, deltas: list[RequestDelta], failed: dict[str, str]) -> None:
        """Loop thread: fan the output thread's deltas out to the streams."""
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
