"""The EngineCore in a process of its own, so HTTP and text work never hold the GIL a GPU step waits for.

The server sends small pickled messages through a queue (requests, aborts, shutdown); the engine process
warms up (warmup.py), reports ready, then loops ``core.step()``. Each iteration's outputs go back as one
``StepBatch`` of flat columns (step_outputs.py) through a pipe, written by a sender thread: the step loop
only appends to the sender's pending batch, so it never waits on the pipe, and batches that the server has
not taken yet merge into one. A thread of the server reads the pipe: a blocking ``recv`` releases the GIL,
so waiting costs the server's event loop nothing. CUDA is initialised in the engine process only (spawn
context: nothing of the server's state is forked into it). The server's reader thread is the only one
that reaps the process.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from graphserve.config import EngineConfig
from graphserve.engine.telemetry import Telemetry
from graphserve.server.step_outputs import StepOutputs

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
    warmup: dict[str, float] = field(default_factory=dict)  # what the warm-up ran (warmup.py)


@dataclass
class EngineLoadFailed:
    message: str


@dataclass
class StepBatch:
    outputs: StepOutputs  # new tokens of the iterations since the previous batch
    failed: dict[str, str]  # request id -> why it failed
    stats: Any  # EngineStats after the latest iteration
    records: list[Any]  # StepRecords of the steps since the previous batch
    admitted: int = 0  # sequences these iterations took from the queue

    def merge(self, later: StepBatch) -> None:
        self.outputs.extend(later.outputs)
        self.failed.update(later.failed)
        self.stats = later.stats
        self.records += later.records
        self.admitted += later.admitted


@dataclass
class CoreView:
    """What the server keeps of a core that lives in the engine process; the routes read it as ``engine.core``."""

    tokenizer: Any
    info: Any  # ModelInfo
    chat_template: str | None
    max_model_len: int
    telemetry: Telemetry = field(default_factory=Telemetry)  # fed with the engine's StepRecords


class _Sender:
    """Writes batches to the pipe on a thread of its own; ``put`` merges into the pending batch and returns.
    Every other engine -> server message goes through ``send_message``: one writer thread, so messages never
    interleave on the pipe, and each goes out after the batches put before it."""

    def __init__(self, outbox: Connection):
        self._outbox = outbox
        self._cond = threading.Condition()
        self._pending: StepBatch | None = None
        self._messages: list[Any] = []
        self._closed = False
        self.broken = False  # the server is gone
        self._thread = threading.Thread(target=self._run, name="graphserve-engine-sender", daemon=True)
        self._thread.start()

    def put(self, batch: StepBatch) -> None:
        with self._cond:
            if self._pending is None:
                self._pending = batch
            else:
                self._pending.merge(batch)
            self._cond.notify()

    def send_message(self, message: Any) -> None:
        with self._cond:
            if self._pending is not None:  # keep the order: the batch so far goes first
                self._messages.append(self._pending)
                self._pending = None
            self._messages.append(message)
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._messages and not self._closed:
                    self._cond.wait()
                out, self._messages = self._messages, []
                if self._pending is not None:
                    out.append(self._pending)
                    self._pending = None
                if not out:
                    return
            try:
                for message in out:
                    self._outbox.send(message)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self.broken = True
                return


def engine_main(config: EngineConfig, inbox: Any, outbox: Connection, log_level: int, log_format: str | None) -> None:
    """The engine process: load the model, warm up, report ready, then serve iterations until Shutdown."""
    logging.basicConfig(level=log_level, format=log_format or logging.BASIC_FORMAT, force=True)
    # Ctrl-C (and a service manager's SIGTERM) reach the whole process group: the server drains its requests,
    # then sends Shutdown. A server that dies without doing so is noticed through the queue and the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from graphserve.engine.core import EngineCore
    from graphserve.server.core_driver import CoreDriver
    from graphserve.server.warmup import warm_up

    try:
        core = EngineCore(config)
        warm = warm_up(core)
    except BaseException as exc:  # noqa: BLE001 - reported to the server, which exits non-zero
        logger.exception("engine failed to load %s", config.model)
        outbox.send(EngineLoadFailed(f"{type(exc).__name__}: {getattr(exc, 'message', None) or exc}"))
        return
    logger.info("warm-up finished: %d requests, %d steps, %d prefill lengths, decode sizes up to %d in %.2f s",
                warm["requests"], warm["steps"], warm["prefill_lengths"], warm["decode_sizes"], warm["seconds"])
    records: list[Any] = []
    core.telemetry.add_listener(records.append)
    bm = core.block_manager
    outbox.send(EngineReady(core.info, core.chat_template, core.max_model_len, bm.num_usable_blocks, bm.block_size,
                            core.stats(), warm))
    sender = _Sender(outbox)
    try:
        _serve(core, CoreDriver(core), inbox, sender, records)
    finally:
        sender.close()


def _serve(core: Any, driver: Any, inbox: Any, sender: _Sender, records: list[Any]) -> None:
    parent = multiprocessing.parent_process()
    reported: set[str] = set()  # requests whose first-seen facts went out
    while not sender.broken:
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
                start_profile(driver, msg, sender.send_message)
            elif isinstance(msg, FlushPrefixCache):
                driver.flush_prefix_cache()
        outputs, failed = driver.iterate(new, aborts, faulty)
        flat = StepOutputs()
        flat.add_core_outputs(outputs, reported)
        reported.difference_update(failed)
        sender.put(StepBatch(flat, failed, core.stats(), records[:],
                             admitted=sum(r.params.n for r in new)))
        records.clear()


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
    server did not ask for. The reader thread is the process's one owner: it alone waits for and reaps it.
    ``shutdown`` asks it to stop, waits for the reader to see it gone, and kills it only while it is not
    reaped (under the lock the reaper takes), so a signal never goes to a reaped, possibly reused, pid.
    """

    def __init__(self, config: EngineConfig, on_message: Callable[[Any], None], on_exit: Callable[[int | None], None],
                 target: Callable[..., None] = engine_main):
        self.config = config
        self._on_message = on_message
        self._on_exit = on_exit
        ctx = multiprocessing.get_context("spawn")
        self._inbox = ctx.Queue()
        self._inbox.cancel_join_thread()  # never block the server's exit on a dead engine's queue
        self._outbox, child_end = ctx.Pipe(duplex=False)
        root = logging.getLogger()
        fmt = next((getattr(h.formatter, "_fmt", None) for h in root.handlers if h.formatter is not None), None)
        self.process = ctx.Process(target=target, name="graphserve-engine",
                                   args=(config, self._inbox, child_end, root.getEffectiveLevel(), fmt), daemon=True)
        self._child_end = child_end
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._reap_lock = threading.Lock()
        self._reaped = threading.Event()
        self.exitcode: int | None = None
        self.killed = False  # shutdown had to SIGKILL it

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.pid is not None and not self._reaped.is_set()

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
        if self._reader is None:
            return  # never started
        if not self._reaped.is_set():
            self._inbox.put(Shutdown())
        if not self._reaped.wait(timeout):
            with self._reap_lock:
                if not self._reaped.is_set():
                    logger.warning("engine process %s did not stop within %.0f s: killing it", self.pid, timeout)
                    self.killed = True
                    self.process.kill()
            self._reaped.wait(5)
        self._inbox.close()
        if self._reader is not threading.current_thread():
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
        # The pipe closes when the process exits (or closes it just before): wait on its sentinel, then reap.
        multiprocessing.connection.wait([self.process.sentinel])
        with self._reap_lock:
            self.process.join()
            self.exitcode = self.process.exitcode
            self._reaped.set()
        if not self._stopping:
            self._stopping = True
            self._on_exit(self.exitcode)
