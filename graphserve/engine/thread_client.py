"""The engine on a thread of the front-end's process (``--engine-in-process``): the ``EngineClient`` whose engine
needs no second process.

The thread runs the serve loop an engine process runs (serve_loop.run_engine), fed from a queue of the same
messages; the core has no locks, so only that thread touches it. Its messages back reach ``on_message`` on
that thread: ``on_message`` hands step outputs to the output thread and returns.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

from graphserve.config import EngineConfig
from graphserve.engine.client import MessageClient, OnExit, OnMessage
from graphserve.engine.messages import Shutdown, StepBatch

if TYPE_CHECKING:
    from graphserve.engine.core_driver import CoreDriver

logger = logging.getLogger(__name__)


class LocalCount:
    """The queue-bound counter of a client whose engine is in this process: a ``SharedCount`` under a thread
    lock."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def get_lock(self) -> threading.Lock:
        return self._lock


class DirectSender:
    """The serve loop's sender for an engine on a thread: each batch and message goes to ``on_message`` on the
    engine's thread, with no thread between (an engine process needs one for its pipe; here ``on_message`` only
    appends to the output thread's queue and runs the step listeners, as the core's own listeners would)."""

    broken = False

    def __init__(self, on_message: OnMessage):
        self._on_message = on_message

    def put(self, batch: StepBatch) -> None:
        self._on_message(batch)

    def send_message(self, message: object) -> None:
        self._on_message(message)

    def close(self, timeout: float = 5.0) -> None:
        pass


class ThreadClient(MessageClient):
    def __init__(self, config: EngineConfig, on_message: OnMessage, on_exit: OnExit):
        self.config = config
        self.frontend = 0
        self.queued = LocalCount()
        self.driver: CoreDriver | None = None  # set once the core is loaded (the profile route's hook)
        self._on_message = on_message
        self._on_exit = on_exit
        self._inbox: queue.Queue = queue.Queue()
        self._stopping = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="graphserve-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.ident is not None and not self._done.is_set()

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._inbox.put(Shutdown())
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _keep_driver(self, driver: CoreDriver) -> None:
        self.driver = driver

    def _run(self) -> None:
        from graphserve.engine.serve_loop import run_engine

        sender = DirectSender(self._on_message)
        try:
            run_engine(self.config, self._inbox, [sender], self.queued, own_process=False,  # type: ignore[list-item]
                       on_driver=self._keep_driver)
        except BaseException:  # noqa: BLE001 - a fault outside any step: the engine is gone, the front-end is told
            logger.exception("the engine thread failed")
        finally:
            sender.close()
            self._done.set()
        if not self._stopping:
            self._stopping = True
            self._on_exit(None)
