"""The EngineCore in a process of its own, so HTTP and text work never hold the GIL a GPU step waits for.

The server sends small pickled messages through a queue (requests, aborts, shutdown); the engine process
loops ``core.step()`` and sends back one ``StepBatch`` per iteration (core outputs, failures, stats and the
new StepRecords) through a pipe. A thread of the server reads that pipe: a blocking ``recv`` releases the
GIL, so waiting costs the server's event loop nothing. CUDA is initialised in the engine process only
(spawn context: nothing of the server's state is forked into it).
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from graphserve.config import EngineConfig
from graphserve.engine.telemetry import Telemetry

logger = logging.getLogger("graphserve.server")

_IDLE_POLL_S = 1.0  # how often an idle engine process checks that the server is still alive


# -- server -> engine ----------------------------------------------------------------------------------------

@dataclass
class AddRequests:
    requests: list[Any]  # EngineRequests, validated and tokenized by the server
    faulty: set[str] = field(default_factory=set)  # test-only fault injection: these ids fail their next step


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class FlushPrefixCache:
    """Drop the prefix cache before the next step (/flush_cache)."""


@dataclass
class Shutdown:
    pass


@dataclass
class ProfileSteps:
    """Both ways (graphserve profile): the server asks the engine to profile its next ``steps`` decode steps
    (0 cancels the one running); the engine answers with the same message, ``result`` filled."""

    token: int
    steps: int
    result: dict | None = None


# -- engine -> server ----------------------------------------------------------------------------------------

@dataclass
class EngineReady:
    info: Any  # ModelInfo
    chat_template: str | None
    max_model_len: int
    num_usable_blocks: int
    block_size: int
    stats: Any  # EngineStats


@dataclass
class EngineLoadFailed:
    message: str


@dataclass
class StepBatch:
    outputs: list[Any]  # CoreOutputs of one iteration
    failed: dict[str, str]  # request id -> why it failed
    stats: Any  # EngineStats after the iteration
    records: list[Any]  # StepRecords of the steps since the previous batch
    admitted: int = 0  # requests this iteration took from the queue


@dataclass
class CoreView:
    """What the server keeps of a core that lives in the engine process; the routes read it as ``engine.core``."""

    tokenizer: Any
    info: Any  # ModelInfo
    chat_template: str | None
    max_model_len: int
    telemetry: Telemetry = field(default_factory=Telemetry)  # fed with the engine's StepRecords


def engine_main(config: EngineConfig, inbox: Any, outbox: Connection, log_level: int, log_format: str | None) -> None:
    """The engine process: load the model, report ready, then serve iterations until Shutdown."""
    logging.basicConfig(level=log_level, format=log_format or logging.BASIC_FORMAT, force=True)
    # Ctrl-C (and a service manager's SIGTERM) reach the whole process group: the server drains its requests,
    # then sends Shutdown. A server that dies without doing so is noticed through the queue and the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from graphserve.engine.core import EngineCore
    from graphserve.server.core_driver import CoreDriver

    try:
        core = EngineCore(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the server, which exits non-zero
        logger.exception("engine failed to load %s", config.model)
        outbox.send(EngineLoadFailed(f"{type(exc).__name__}: {getattr(exc, 'message', None) or exc}"))
        return
    records: list[Any] = []
    core.telemetry.add_listener(records.append)
    bm = core.block_manager
    outbox.send(EngineReady(core.info, core.chat_template, core.max_model_len, bm.num_usable_blocks, bm.block_size,
                            core.stats()))
    driver = CoreDriver(core)
    parent = multiprocessing.parent_process()
    while True:
        messages = []
        if not driver.has_work():
            try:
                messages.append(inbox.get(timeout=_IDLE_POLL_S))
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return  # the server is gone: nobody to serve
                continue
        while True:  # everything that arrived during the last step
            try:
                messages.append(inbox.get_nowait())
            except queue.Empty:
                break
        new: list[Any] = []
        aborts: list[str] = []
        faulty: set[str] = set()
        for msg in messages:
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AddRequests):
                new += msg.requests
                faulty |= msg.faulty
            elif isinstance(msg, AbortRequests):
                aborts += msg.request_ids
            elif isinstance(msg, ProfileSteps):
                start_profile(driver, msg, outbox.send)
            elif isinstance(msg, FlushPrefixCache):
                driver.flush_prefix_cache()
        outputs, failed = driver.iterate(new, aborts, faulty)
        batch = StepBatch(outputs, failed, core.stats(), records[:], admitted=len(new))
        records.clear()
        try:
            outbox.send(batch)
        except (BrokenPipeError, ConnectionResetError):
            return  # the server is gone


def start_profile(driver: Any, msg: ProfileSteps, send: Callable[[Any], None]) -> None:
    """Engine side of POST /v1/profile: the driver runs its next steps through a StepProfiler."""
    from graphserve.engine.step_profiler import StepProfiler

    running = driver.profiler is not None and driver.profiler.active
    if msg.steps == 0:
        if running:
            driver.profiler.close()
        return
    if running:
        send(ProfileSteps(msg.token, msg.steps, {"error": "a profile is already running", "code": 429}))
        return
    driver.profiler = StepProfiler(driver.core, msg.steps, lambda r: send(ProfileSteps(msg.token, msg.steps, r)))


class EngineProcess:
    """The server's handle on the engine process: start it, send it messages, read its replies on a thread.

    ``on_message`` and ``on_exit(exitcode)`` run on the reader thread; ``on_exit`` only for an exit the
    server did not ask for.
    """

    def __init__(self, config: EngineConfig, on_message: Callable[[Any], None], on_exit: Callable[[int | None], None]):
        self.config = config
        self._on_message = on_message
        self._on_exit = on_exit
        ctx = multiprocessing.get_context("spawn")
        self._inbox = ctx.Queue()
        self._inbox.cancel_join_thread()  # never block the server's exit on a dead engine's queue
        self._outbox, child_end = ctx.Pipe(duplex=False)
        root = logging.getLogger()
        fmt = next((getattr(h.formatter, "_fmt", None) for h in root.handlers if h.formatter is not None), None)
        self.process = ctx.Process(target=engine_main, name="graphserve-engine",
                                   args=(config, self._inbox, child_end, root.getEffectiveLevel(), fmt), daemon=True)
        self._child_end = child_end
        self._stopping = False
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def start(self) -> None:
        self.process.start()
        # Our copy of the child's end must go: with it open, recv() would never see the child exit.
        self._child_end.close()
        self._reader = threading.Thread(target=self._read, name="graphserve-engine-reader", daemon=True)
        self._reader.start()

    def send(self, message: Any) -> None:
        if not self._stopping:
            self._inbox.put(message)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self.process.is_alive():
            self._inbox.put(Shutdown())
            self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("engine process %s did not stop within %.0f s: killing it", self.pid, timeout)
            self.process.kill()
            self.process.join(5)
        self._inbox.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)

    def _read(self) -> None:
        while True:
            try:
                message = self._outbox.recv()
            except (EOFError, OSError):
                break
            try:
                self._on_message(message)
            except Exception:  # noqa: BLE001 - a broken handler must not stop the reader
                logger.exception("handling an engine message failed")
        self.process.join(5)
        if not self._stopping:
            self._stopping = True
            self._on_exit(self.process.exitcode)

