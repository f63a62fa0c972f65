"""``ProcessClient``: the ``EngineClient`` of an engine in a process of its own, so HTTP and text work never
hold the GIL a GPU step waits for.

The front-end sends small pickled messages through a queue (requests, aborts, shutdown); the engine process
(serve_loop.py) warms up, reports ready, then loops ``core.step()`` and sends each iteration's outputs back
as one ``StepBatch`` of flat columns through a pipe. A thread of the front-end reads the pipe: a blocking
``recv`` releases the GIL, so waiting costs the event loop nothing. CUDA is initialised in the engine process
only (spawn context: nothing of the server's state is forked into it).

Built without a channel, the client starts and owns the engine process for a server of one HTTP process: its
reader thread is the only one that reaps it. With ``--api-server-count N`` the supervisor
(server/api_servers.py) owns the engine and each front-end's client is built with an ``EngineChannel``: the
shared queue, its own pipe, its index. Such a client sees the engine die as the end of its pipe.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from graphserve.config import EngineConfig
from graphserve.engine.client import MessageClient, OnExit, OnMessage
from graphserve.engine.messages import Shutdown
from graphserve.engine.serve_loop import engine_main

logger = logging.getLogger(__name__)


def log_setup() -> tuple[int, str | None]:
    """(level, format) of this process's root logger, for the engine process to log the same way."""
    root = logging.getLogger()
    fmt = next((getattr(h.formatter, "_fmt", None) for h in root.handlers if h.formatter is not None), None)
    return root.getEffectiveLevel(), fmt


@dataclass
class EngineChannel:
    """What one front-end of several gets from the supervisor (picklable into a spawned process)."""

    inbox: Any  # the queue every front-end puts on
    outbox: Connection  # this front-end's end of its own pipe
    index: int  # which front-end this is: AddRequests carry it
    queued: Any  # the shared count of queued sequences (serve_loop.py)
    ready: Any  # the shared count of front-ends ready to serve: /health says 200 once all are
    count: int  # front-ends in all


class ProcessClient(MessageClient):
    """``on_message`` and ``on_exit(exitcode)`` run on the reader thread; ``on_exit`` only for an exit the
    server did not ask for. An owning client's reader thread is the process's one owner: it alone waits for and
    reaps it. ``shutdown`` asks it to stop, waits for the reader to see it gone, and kills it only while it is
    not reaped (under the lock the reaper takes), so a signal never goes to a reaped, possibly reused, pid.
    """

    def __init__(self, config: EngineConfig, on_message: OnMessage, on_exit: OnExit,
                 channel: EngineChannel | None = None, target: Callable[..., None] = engine_main):
        self.config = config
        self._on_message = on_message
        self._on_exit = on_exit
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._reaped = threading.Event()  # the engine is gone: reaped (owner) or its pipe closed (shared)
        self.exitcode: int | None = None
        self.killed = False  # shutdown had to SIGKILL it
        self.process: Any = None
        if channel is not None:  # one front-end of several: the supervisor owns the engine
            self._inbox, self._outbox = channel.inbox, channel.outbox
            self.queued, self.frontend = channel.queued, channel.index
            return
        ctx = multiprocessing.get_context("spawn")
        self._inbox = ctx.Queue()
        self._inbox.cancel_join_thread()  # never block the server's exit on a dead engine's queue
        self._outbox, child_end = ctx.Pipe(duplex=False)
        self.queued = ctx.Value("q", 0)
        self.frontend = 0
        level, fmt = log_setup()
        self.process = ctx.Process(target=target, name="graphserve-engine",
                                   args=(config, self._inbox, [child_end], level, fmt, self.queued), daemon=True)
        self._child_end = child_end
        self._reap_lock = threading.Lock()

    @property
    def owner(self) -> bool:
        return self.process is not None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.owner else None

    @property
    def alive(self) -> bool:
        started = self.process.pid is not None if self.owner else self._reader is not None
        return started and not self._reaped.is_set()

    def start(self) -> None:
        if self.owner:
            self.process.start()
            # Our copy of the child's end must go: with it open, recv() would never see the child exit.
            self._child_end.close()
        self._reader = threading.Thread(target=self._read, name="graphserve-engine-reader", daemon=True)
        self._reader.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        if not self.owner or self._reader is None:
            return  # the supervisor stops a shared engine once every front-end has exited; or never started
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
        if self.owner:
            # The pipe closes when the process exits (or closes it just before): wait on its sentinel, then reap.
            multiprocessing.connection.wait([self.process.sentinel])
            with self._reap_lock:
                self.process.join()
                self.exitcode = self.process.exitcode
                self._reaped.set()
        else:
            self._reaped.set()
        if not self._stopping:
            self._stopping = True
            self._on_exit(self.exitcode)
