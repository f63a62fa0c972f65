"""How long Python's garbage collector ran: a step's record carries the collector time of its interval.

A prefill that runs eagerly is host-bound (hundreds of kernel launches from Python), so a collection in the
middle of it lengthens the step by its whole pause, and a lone request's TTFT with it. ``gc.callbacks``
reports every collection's start and stop; this sums their durations until the engine takes the total.
One clock per process, installed on first use; the callback costs a clock read per collection.
"""

from __future__ import annotations

import gc
import threading
import time


class GcClock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = 0.0
        self._total = 0.0  # seconds collected since the last take()
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            with self._lock:
                self._total += time.perf_counter() - self._started
            self._started = 0.0

    def take_ms(self) -> float:
        """Collector time since the previous call, in ms."""
        with self._lock:
            total, self._total = self._total, 0.0
        return 1000.0 * total


_CLOCK: GcClock | None = None
_CLOCK_LOCK = threading.Lock()


def gc_clock() -> GcClock:
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
    The collector time it saves is taken from gc_clock, so the freeze's own collection is nobody's step."""
    gc.collect()
    gc.freeze()
    gc_clock().take_ms()
