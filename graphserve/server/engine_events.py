"""What the engine tells a front-end, applied to the front-end's Frontend.

A thread of the engine client (engine/client.py) calls these, off the event loop: step outputs go
to the output thread and the step records to the telemetry listeners from here; the engine's death reaches
the loop through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from graphserve.engine.messages import CoreView, EngineLoadFailed, EngineReady, ProfileSteps, StepBatch
from graphserve.errors import GraphserveError, InternalError, ModelLoadError

if TYPE_CHECKING:
    import asyncio
    import threading

    from graphserve.config import EngineConfig
    from graphserve.engine.process_client import EngineChannel
    from graphserve.engine.telemetry import EngineStats
    from graphserve.server.cache_events import CacheEventLog
    from graphserve.server.output_pump import OutputPump
    from graphserve.server.profile_route import ProfileBroker

logger = logging.getLogger("graphserve.server")


class FrontendState(Protocol):
    """What the engine's events read and set on the front-end (server/frontend.Frontend), declared here so that
    these handlers do not import the front-end that builds them."""

    config: EngineConfig
    replica: int | None
    separate_process: bool
    channel: EngineChannel | None
    ready: threading.Event
    load_error: BaseException | None
    engine_error: str | None
    stats: EngineStats | None
    warmup: dict[str, float]
    core: CoreView | None
    cache_events: CacheEventLog
    on_cache_events: Callable[[list[tuple]], None] | None
    profiles: ProfileBroker
    _pump: OutputPump | None
    _on_step: Callable[[Any], None] | None
    _loop: asyncio.AbstractEventLoop | None

    @property
    def num_inflight(self) -> int: ...

    def _serving(self, core: CoreView, num_usable_blocks: int, block_size: int) -> None: ...

    def abort_all(self, error: GraphserveError) -> int: ...


class EngineEvents:
    """The message and exit handlers the engine client is built with, for ``engine``."""

    def __init__(self, engine: FrontendState):
        self.engine = engine

    def on_message(self, msg: Any) -> None:
        engine = self.engine
        if isinstance(msg, StepBatch):
            engine.stats = msg.stats
            # The cache events before the tokens: a request sent once this step's outputs reached their client
            # is routed knowing the blocks they left (server/replicas.py).
            if msg.cache_events:
                if engine.on_cache_events is not None:
                    engine.on_cache_events(msg.cache_events)
                else:
                    engine.cache_events.extend(msg.cache_events)
            if engine._pump is not None:  # tokens first: the output thread detokenizes while the listeners run
                engine._pump.push(msg.outputs, msg.failed)
            if msg.records and engine.core is not None:
                engine.core.telemetry.extend(msg.records)  # listeners (metrics, step log) run here, off the loop
        elif isinstance(msg, EngineReady):
            self._on_ready(msg)
        elif isinstance(msg, ProfileSteps):
            engine.profiles.on_result(msg)
        elif isinstance(msg, EngineLoadFailed):
            engine.load_error = ModelLoadError(msg.message)
            engine.ready.set()

    def _on_ready(self, msg: EngineReady) -> None:
        engine = self.engine
        try:
            from graphserve.models.loader import load_tokenizer

            core = CoreView(load_tokenizer(engine.config.model), msg.info, msg.chat_template, msg.max_model_len)
            if engine._on_step is not None:
                core.telemetry.add_listener(engine._on_step)
            engine._serving(core, msg.num_usable_blocks, msg.block_size)
            engine.stats = msg.stats
            engine.warmup = msg.warmup
            if engine.channel is not None:
                with engine.channel.ready.get_lock():
                    engine.channel.ready.value += 1
        except Exception as exc:  # noqa: BLE001 - reported to the launcher, which exits non-zero
            logger.exception("loading the tokenizer of %s failed", engine.config.model)
            engine.load_error = exc
        engine.ready.set()

    def on_exit(self, exitcode: int | None) -> None:
        engine = self.engine
        where = "process" if engine.separate_process else "thread"
        if not engine.ready.is_set():
            who = "the engine" if engine.replica is None else f"replica {engine.replica}: its engine"
            engine.load_error = ModelLoadError(f"{who} {where} exited with code {exitcode} while loading")
            engine.ready.set()
            return
        code = "" if exitcode is None else f" (exit code {exitcode})"
        if engine.replica is None:
            engine.engine_error = f"the engine {where} died{code}; restart the server"
        else:  # the other replicas serve on (server/replicas.py)
            engine.engine_error = f"replica {engine.replica}: its engine {where} died{code}"
        logger.error("%s: failing %d in-flight request(s)", engine.engine_error, engine.num_inflight)
        assert engine._loop is not None
        engine._loop.call_soon_threadsafe(engine.abort_all, InternalError(engine.engine_error))
