"""The engine core on a thread of the server process (``--engine-in-process``).

The core has no locks, so only this thread touches it. Requests, aborts and cache flushes come in through a
locked inbox that the thread drains between steps; with no work it sleeps on a condition. Its outputs go to
the AsyncEngine's output thread (output_pump.py), as the engine process's do.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from graphserve.engine.step_outputs import StepOutputs
from graphserve.server.core_driver import CoreDriver

if TYPE_CHECKING:
    from graphserve.server.async_engine import AsyncEngine
    from graphserve.server.compile_watch import CompileWatch

logger = logging.getLogger("graphserve.server")


class EngineThread:
    """Loads the core, then steps it while there is work, for ``engine`` (whose load state it sets)."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.driver: CoreDriver | None = None  # set once the core is loaded
        self._cond = threading.Condition()
        self._inbox: list[Any] = []  # EngineRequests to add
        self._aborts: list[str] = []
        self._faulty: set[str] = set()
        self._flush_cache = False
        self._stopped = False
        self._waiting_in_core = 0  # sequences
        self._watch: CompileWatch | None = None  # compiles after ready, logged (GPU only)
        self._thread = threading.Thread(target=self._run, name="graphserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)

    def queued_sequences(self) -> int:
        return self._waiting_in_core + sum(r.params.n for r in self._inbox)

    def add(self, request: Any, faulty: set[str]) -> None:
        with self._cond:
            self._faulty |= faulty
            self._inbox.append(request)
            self._cond.notify()

    def abort(self, ids: list[str]) -> None:
        with self._cond:
            self._aborts.extend(ids)
            self._cond.notify()

    def flush_prefix_cache(self) -> None:
        with self._cond:
            self._flush_cache = True
            self._cond.notify()

    def _load(self) -> None:
        from graphserve.engine.core import EngineCore
        from graphserve.server.compile_watch import watch_compiles
        from graphserve.server.warmup import warm_up

        engine = self.engine
        self._watch = watch_compiles(engine.config)
        core = EngineCore(engine.config)
        engine.warmup = warm_up(core)
        if self._watch is not None:
            self._watch.ready()
        self.driver = CoreDriver(core)
        engine._serving(core, core.block_manager.num_usable_blocks, core.block_manager.block_size)
        if engine._on_step is not None:
            core.telemetry.add_listener(engine._on_step)
        engine.stats = core.stats()

    def _run(self) -> None:
        try:
            self._serve()
        finally:  # the compile hook is process-wide: an in-process engine's ends with it
            if self._watch is not None:
                self._watch.close()

    def _serve(self) -> None:
        engine = self.engine
        try:
            self._load()
        except BaseException as exc:  # noqa: BLE001 - reported to the launcher, which exits non-zero
            engine.load_error = exc
            logger.exception("engine failed to load %s", engine.config.model)
            engine.ready.set()
            return
        engine.ready.set()
        driver = self.driver
        assert driver is not None
        reported: set[str] = set()
        while True:
            with self._cond:
                while not (self._stopped or self._inbox or self._aborts or self._flush_cache or driver.has_work()):
                    self._cond.wait()
                if self._stopped:
                    return
                flush, self._flush_cache = self._flush_cache, False
                new, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                faulty, self._faulty = self._faulty, set()
            if flush:
                driver.flush_prefix_cache()
            outputs, failed = driver.iterate(new, aborts, faulty)
            engine.stats = driver.core.stats()
            self._waiting_in_core = int(engine.stats.waiting)
            if outputs or failed:
                flat = StepOutputs()
                flat.add_core_outputs(outputs, reported)
                reported.difference_update(failed)
                assert engine._pump is not None
                engine._pump.push(flat, failed)
