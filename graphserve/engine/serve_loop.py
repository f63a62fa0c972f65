"""The engine's serve loop: load, warm up, report ready, then loop ``core.step()`` for one or more front-ends,
in an engine process of its own (``engine_main``, process_client.py) or on a thread of the server's
(thread_client.py).

Every HTTP front-end process puts its requests on one shared queue (tagged with its index) and reads its
own pipe; each iteration's outputs go to their owners through output_router.py.

The queue bound is global: ``queued`` is a shared counter of sequences sent by any front-end that the engine
has not scheduled yet (in transit, or waiting in the core). A front-end reserves a request's sequences in
it before sending; this loop takes off what it pulled and adds what still waits after each iteration.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from graphserve.config import EngineConfig
from graphserve.engine.core_driver import CoreDriver
from graphserve.engine.cpu_affinity import pin_engine_process
from graphserve.engine.messages import (
    AbortRequests,
    AddRequests,
    EngineLoadFailed,
    EngineReady,
    FlushPrefixCache,
    ProfileSteps,
    Shutdown,
    StepBatch,
)
from graphserve.engine.output_router import OutputRouter, Sender
from graphserve.errors import ConfigError

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 1.0  # an idle engine blocks on its queue this long, then checks that its parent is alive
# After its last step a GPU engine polls its queue without sleeping for this long before it blocks: a host
# thread that slept wakes slowly (`python3 -m benchmarks.idle_wake`: the `sleep` against the `spin` rows of
# benchmarks/results/idle_wake_llama3-8b.json). On the CPU the engine's own kernels need the cores, so it
# never spins there.
IDLE_SPIN_S = 2.0
# A thread that wants the GIL waits for the holder to release it, at the latest after the switch interval
# (5 ms by default). The step loop runs long pure-Python stretches (scheduling, building a batch's inputs)
# while a sender thread waits to ship tokens a full pipe did not take (output_router.py): 0.5 ms bounds that wait
# an order tighter.
SWITCH_INTERVAL_S = 0.0005


def engine_main(config: EngineConfig, inbox: Any, outboxes: list[Connection], log_level: int,
                log_format: str | None, queued: Any) -> None:
    """The engine process: serve its front-ends (``run_engine``) until Shutdown, or until none is left."""
    logging.basicConfig(level=log_level, format=log_format or logging.BASIC_FORMAT, force=True)
    # Ctrl-C (and a service manager's SIGTERM) reach the whole process group: the server drains its requests,
    # then sends Shutdown. A server that dies without doing so is noticed through the queue and the pipes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    refused = None
    try:  # GRAPHSERVE_ENGINE_CPUS: before this process starts any thread, which would keep the CPUs it had
        pin_engine_process()
    except ConfigError as exc:
        refused = exc.message
    senders = [Sender(outbox, i) for i, outbox in enumerate(outboxes)]
    try:
        if refused is not None:
            for sender in senders:
                sender.send_message(EngineLoadFailed(refused))
            return
        run_engine(config, inbox, senders, queued, own_process=True)
    finally:
        for sender in senders:
            sender.close()


def run_engine(config: EngineConfig, inbox: Any, senders: list[Sender], queued: Any, own_process: bool,
               on_driver: Callable[[CoreDriver], None] | None = None) -> None:
    """Load the model, warm up, report ready through every sender, then serve iterations until Shutdown.
    ``own_process``: this process is the engine's alone, so its heap is frozen once loaded (gc_clock.py).
    ``on_driver`` gets the driver before the first iteration (the in-process client keeps it)."""
    from graphserve.engine.compile_watch import watch_compiles
    from graphserve.engine.core import EngineCore
    from graphserve.engine.gc_clock import freeze_heap
    from graphserve.engine.warmup import warm_up

    watch = None
    try:
        watch = watch_compiles(config)
        core = EngineCore(config)
        warm = warm_up(core)
    except BaseException as exc:  # noqa: BLE001 - reported to the front-ends, whose launcher exits non-zero
        logger.exception("engine failed to load %s", config.model)
        for sender in senders:
            sender.send_message(EngineLoadFailed(f"{type(exc).__name__}: {getattr(exc, 'message', None) or exc}"))
        if watch is not None:
            watch.close()
        return
    try:
        logger.info("warm-up finished: %d requests, %d steps, %d prefill lengths, decode sizes up to %d in %.2f s",
                    warm["requests"], warm["steps"], warm["prefill_lengths"], warm["decode_sizes"], warm["seconds"])
        if watch is not None:
            watch.ready()
        if own_process:
            freeze_heap()  # what lives now lives as long as this process: the collector need not walk it again
        records: list[Any] = []
        core.telemetry.add_listener(records.append)
        bm = core.block_manager
        if config.kv_events:  # a router keeps each replica's prefix index from these (server/cache_events.py)
            bm.record_events()
            logger.info("recording the prefix cache's events for GET /v1/cache_events (--kv-events): %d cached "
                        "block(s) so far", len(bm.cached))
        ready = EngineReady(core.info, core.chat_template, core.max_model_len, bm.num_usable_blocks, bm.block_size,
                            core.stats(), warm)
        for sender in senders:
            sender.send_message(ready)
        driver = CoreDriver(core)
        if on_driver is not None:
            on_driver(driver)
        serve(core, driver, inbox, senders, records, queued, idle_spin=own_process)
    finally:  # the compile hook is process-wide: an in-process engine's ends with it
        if watch is not None:
            watch.close()


def spin_until_message(inbox: Any, seconds: float) -> bool:
    """Polls ``inbox`` without sleeping for up to ``seconds``; True once a message is there."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not inbox.empty():  # a zero-timeout poll of the queue's pipe
            return True
    return False


def serve(core: Any, driver: Any, inbox: Any, senders: list[Sender], records: list[Any], queued: Any,
          idle_spin: bool = True) -> None:
    """``idle_spin=False``: never poll without sleeping (an engine on a thread would hold its server's GIL)."""
    parent = multiprocessing.parent_process()
    router = OutputRouter(len(senders))
    waiting = 0  # sequences the core held waiting after the previous iteration
    spin_s = IDLE_SPIN_S if core.device.type == "cuda" and idle_spin else 0.0
    worked = False  # the previous iteration ran a step: spin before blocking
    while not all(s.broken for s in senders):
        messages = []
        if not driver.has_work():
            if worked and spin_s > 0:
                spin_until_message(inbox, spin_s)
            worked = False
            try:  # blocks on the queue's pipe: a request wakes this at once, no polling on the path
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
        pulled = 0  # sequences taken off the shared queue count, added or refused
        refused: list[list[tuple[str, str]]] = [[] for _ in senders]
        for msg in messages:
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AddRequests):
                pulled += sum(r.params.n for r in msg.requests)
                new += router.admit(msg, refused)
                faulty |= msg.faulty
            elif isinstance(msg, AbortRequests):
                aborts += msg.request_ids
                for engine_id in msg.request_ids:  # a rid is free again once its request is aborted
                    router.forget(engine_id)
            elif isinstance(msg, ProfileSteps):
                start_profile(driver, msg, senders[msg.frontend].send_message)
            elif isinstance(msg, FlushPrefixCache):
                driver.flush_prefix_cache()
        outputs, failed = driver.iterate(new, aborts, faulty)
        worked = True
        stats = core.stats()
        change = int(stats.waiting) - waiting - pulled
        if queued is not None and change:  # steady decode changes nothing: skip the cross-process lock
            with queued.get_lock():
                queued.value += change
        waiting = int(stats.waiting)
        batch_records = records[:]
        records.clear()
        cache_events = core.block_manager.take_events()
        for sender, (flat, fails) in zip(senders, router.split(outputs, failed, refused)):
            # own lists: batches merge in place
            sender.put(StepBatch(flat, fails, stats, list(batch_records), list(cache_events)))


def start_profile(driver: Any, msg: ProfileSteps, send: Callable[[Any], None]) -> None:
    """Engine side of POST /v1/profile: the driver runs its next steps through a StepProfiler."""
    from graphserve.engine.step_profiler import StepProfiler

    running = driver.profiler is not None and driver.profiler.active
    if msg.steps == 0:
        if running:
            driver.profiler.close()
        return
    if running:
        send(ProfileSteps(msg.token, msg.steps, {"error": "a profile is already running", "code": 429},
                          msg.frontend))
        return
    driver.profiler = StepProfiler(driver.core, msg.steps,
                                   lambda r: send(ProfileSteps(msg.token, msg.steps, r, msg.frontend)))
