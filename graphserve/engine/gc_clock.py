"""How long Python's garbage collector ran: a step's record carries the collector time of its interval.

A prefill that runs eagerly is host-bound (hundreds of kernel launches from Python), so a collection in the
middle of it lengthens the step by its whole pause, and a lone request's TTFT with it. ``gc.callbacks``
reports every collection's start and stop; the clock adds up their durations into one running total per
process, and each engine takes the difference between two of its steps. Collections never overlap (the
collector runs under the interpreter lock and does not re-enter), so the callback is the total's only
writer and needs no lock; it costs a clock read per collection.
"""

from __future__ import annotations

import gc
import threading
import time


class GcClock:
    def __init__(self) -> None:
        self.total_ms = 0.0  # collector time since the clock was installed
        self.paused = False  # freeze_heap's own collection is nobody's step
        self._started: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if self.paused:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.total_ms += 1000.0 * (time.perf_counter() - self._started)
            self._started = None


_CLOCK: GcClock | None = None
_CLOCK_LOCK = threading.Lock()


def gc_clock() -> GcClock:
    """The process's clock, installed on first use."""
    global _CLOCK
    with _CLOCK_LOCK:
        if _CLOCK is None:
            _CLOCK = GcClock()
        return _CLOCK


def freeze_heap() -> None:
    """Collect once, then move every object alive now (the model, its caches, the warm-up's leftovers) out of
    the collector's reach: later collections walk only what serving allocates. The engine process calls it
    after its warm-up, for objects that live as long as it does; cyclic garbage among frozen objects is
    never freed, so a process that builds engines again and again (tests, in-process servers) must not.
    The clock does not count this collection: it belongs to no step."""
    clock = gc_clock()
    clock.paused = True
    try:
        gc.collect()
        gc.freeze()
    finally:
        clock.paused = False
