"""CPUs of its own for the server's engine process (``GRAPHSERVE_ENGINE_CPUS``), the front-ends kept off them.

A prefill or mixed step runs eagerly, and its launches keep the host busy longer than the device (about 30 ms of
launch_ms for dummy:qwen3-0.6b's 256-token prefill on an H100): any thread that takes the step loop's core
meanwhile lengthens the step by as long as it runs. Under streaming clients the front-end's busiest moment
(tokenizing a wave of new prompts, the last events of the old ones, new connections) falls on exactly those
steps. On CPU with an eager step's launches emulated (``python3 -m benchmarks.serve_waves``, 64 clients, 3 waves;
results/serve_waves_free, _shared and _split.json), the server's prefill and mixed steps took 1.32x the offline
engine's time where the OS placed the processes, 1.70x with the front-end on the engine's core, 1.20x with each on
a core of its own. The step thread's CPU time per step was the offline one's or less in every case, no other thread
of the engine ran, and its time off the CPU was all spent runnable, waiting for its core (schedstat run delay:
4.6, 4.2 and 3.0 ms a step, against 0.4 offline; on that 2-CPU machine other jobs moved onto the engine's core when
the front-end held the other). The rest is one or two more such steps, a wave arriving as it is tokenized.

The server process, before it starts a front-end or the engine, moves all its threads off the listed CPUs (the
processes and threads it starts inherit that); the engine process moves all its threads onto them first thing.
"""

from __future__ import annotations

import logging
import os

from graphserve import env
from graphserve.errors import ConfigError

logger = logging.getLogger(__name__)

ENV = "GRAPHSERVE_ENGINE_CPUS"


def parse_cpus(text: str) -> set[int]:
    """A ``taskset -c`` list (``0``, ``0,2``, ``4-7``, ``0,4-5``) as a set of CPU ids."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ConfigError(f"{ENV}={text!r} is invalid: {part!r} is no CPU id or range (write e.g. 0 or 0,2-3)",
                              param=ENV)
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ConfigError(f"{ENV}={text!r} is invalid: the range {part!r} runs backwards", param=ENV)
        cpus.update(range(first, last + 1))
    return cpus


def engine_cpus() -> set[int] | None:
    """The CPUs the switch gives the engine (None where unset or empty), checked against the CPUs this process may
    use: each must be one of them, and at least one must be left for the front-ends."""
    text = env.get(ENV)
    if not text:
        return None
    cpus = parse_cpus(text)
    allowed = os.sched_getaffinity(0)
    outside = sorted(cpus - allowed)
    if outside:
        raise ConfigError(f"{ENV}={text!r} is invalid: CPU(s) {outside} are not among the {len(allowed)} this "
                          f"process may use ({_ranges(allowed)})", param=ENV)
    if not allowed - cpus:
        raise ConfigError(f"{ENV}={text!r} is invalid: it takes all {len(allowed)} CPUs this process may use "
                          f"({_ranges(allowed)}); leave at least one for the HTTP front-ends", param=ENV)
    return cpus


def keep_server_off_engine_cpus() -> set[int] | None:
    """Server start, before any thread or child process: this process leaves the engine's CPUs (its threads and
    children inherit that); returns them, or None where the switch is unset."""
    cpus = engine_cpus()
    if cpus is None:
        return None
    rest = os.sched_getaffinity(0) - cpus
    set_process_cpus(rest)
    logger.info("engine process on CPU(s) %s (%s), the HTTP front-ends on %s", _ranges(cpus), ENV, _ranges(rest))
    return cpus


def pin_engine_process() -> None:
    """The engine process, first thing: onto the switch's CPUs (the threads it starts later inherit them)."""
    text = env.get(ENV)
    if not text:
        return
    cpus = parse_cpus(text)
    try:
        set_process_cpus(cpus)
    except OSError as exc:  # a CPU that is offline or outside the cgroup's set
        raise ConfigError(f"{ENV}={text!r} is invalid: the engine process cannot run there ({exc})",
                          param=ENV) from exc
    import torch

    # torch's own threads sized for the whole machine would take turns on these CPUs (a CPU engine's kernels)
    torch.set_num_threads(min(torch.get_num_threads(), len(cpus)))


def set_process_cpus(cpus: set[int]) -> None:
    """Every thread of this process onto ``cpus``: a thread keeps the CPUs it had, and imports (torch's among them)
    start threads before any code of ours runs."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread, and those it starts
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def _ranges(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` as ``0-2,5``."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
