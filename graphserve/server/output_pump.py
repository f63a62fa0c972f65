"""The server's output thread: engine batches in, request deltas out to the event loop.

Whoever receives the engine's batches (the pipe reader, or the in-process engine thread) only appends them
here and returns at once. This thread takes everything that accumulated, merges it into one batch,
detokenizes (engine/output_processor.py) and hands the deltas to the loop in one callback. If the loop or this thread falls
behind, batches merge and each choice is detokenized once for several tokens: the server coalesces, the
engine never waits.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from graphserve.engine.output_processor import OutputProcessor, RequestDelta
from graphserve.engine.step_outputs import StepOutputs

logger = logging.getLogger("graphserve.server")

# (deltas, failed id -> why) -> None, called on the loop
Deliver = Callable[[list[RequestDelta], dict[str, str]], None]


class OutputPump:
    def __init__(self, processor: OutputProcessor, loop: asyncio.AbstractEventLoop, deliver: Deliver):
        self.processor = processor
        self._loop = loop
        self._deliver = deliver
        self._cond = threading.Condition()
        self._outputs = StepOutputs()
        self._failed: dict[str, str] = {}
        self._stopped = False
        self._ready: list[tuple[list[RequestDelta], dict[str, str]]] = []
        self._ready_lock = threading.Lock()
        self._callback_pending = False
        self._thread = threading.Thread(target=self._run, name="graphserve-output", daemon=True)
        self._thread.start()

    def push(self, outputs: StepOutputs, failed: dict[str, str]) -> None:
        """Any thread: queue one batch; never blocks on detokenization."""
        if not outputs and not failed:
            return
        with self._cond:
            self._outputs.extend(outputs)
            self._failed.update(failed)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopped or self._outputs or self._failed):
                    self._cond.wait()
                if self._stopped:
                    return
                outputs, self._outputs = self._outputs, StepOutputs()
                failed, self._failed = self._failed, {}
            try:
                deltas = self.processor.process(outputs)
            except Exception as exc:  # noqa: BLE001 - detokenization broke: fail these requests, never hang them
                logger.exception("output processing failed")
                reason = f"output processing failed: {type(exc).__name__}: {exc}"
                deltas = []
                failed.update({rid: reason for rid in set(outputs.request_ids)})
            self._hand_over(deltas, failed)

    def _hand_over(self, deltas: list[RequestDelta], failed: dict[str, str]) -> None:
        # One loop callback for however many batches are waiting: a busy loop takes them all in one turn.
        with self._ready_lock:
            self._ready.append((deltas, failed))
            if self._callback_pending:
                return
            self._callback_pending = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: the server is exiting
            pass

    def _drain(self) -> None:
        with self._ready_lock:
            ready, self._ready = self._ready, []
            self._callback_pending = False
        for deltas, failed in ready:
            self._deliver(deltas, failed)
