"""The load generator watches itself: a saturated client reports the client's limit as the server's.

Two signals: event-loop lag (a 10 ms ticker; how late each tick wakes up) and process CPU (psutil,
in percent of one core, since the asyncio loop runs on one). A run is flagged client-limited when
the loop lag p99 exceeds 20 ms or mean CPU exceeds 90 %.
"""

from __future__ import annotations

import asyncio
import time

import psutil

from graphserve.bench.metrics import describe

TICK_S = 0.010
LAG_P99_LIMIT_MS = 20.0
CPU_LIMIT_PERCENT = 90.0


class ClientHealth:
    def __init__(self) -> None:
        self.lag_ms: list[float] = []
        self.cpu_percent: list[float] = []
        self._proc = psutil.Process()
        self._tasks: list[asyncio.Task] = []

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + TICK_S
            await asyncio.sleep(TICK_S)
            self.lag_ms.append(max(0.0, (loop.time() - due) * 1000.0))

    async def _cpu(self) -> None:
        self._proc.cpu_percent(None)  # the first call only sets the reference point
        while True:
            await asyncio.sleep(1.0)
            self.cpu_percent.append(self._proc.cpu_percent(None))

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._cpu_t0 = self._proc.cpu_times()
        self._tasks = [asyncio.create_task(self._tick()), asyncio.create_task(self._cpu())]

    async def stop(self) -> dict:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        wall = time.perf_counter() - self._t0
        cpu = self._proc.cpu_times()
        busy = (cpu.user - self._cpu_t0.user) + (cpu.system - self._cpu_t0.system)
        return summarize_health(self.lag_ms, self.cpu_percent, busy / wall * 100.0 if wall > 0 else 0.0)


def summarize_health(lag_ms: list[float], cpu_samples: list[float], cpu_mean: float) -> dict:
    lag = describe(lag_ms)
    warnings = []
    if lag and lag["p99"] > LAG_P99_LIMIT_MS:
        warnings.append(f"client event-loop lag p99 {lag['p99']:.1f} ms > {LAG_P99_LIMIT_MS:.0f} ms: "
                        "the load generator, not the server, may be the limit")
    if cpu_mean > CPU_LIMIT_PERCENT:
        warnings.append(f"client CPU {cpu_mean:.0f}% of a core > {CPU_LIMIT_PERCENT:.0f}%: "
                        "the load generator, not the server, may be the limit")
    return {
        "loop_lag_ms": lag,
        "cpu_percent_mean": cpu_mean,
        "cpu_percent_samples": [round(x, 1) for x in cpu_samples],
        "client_limited": bool(warnings),
        "warnings": warnings,
    }
