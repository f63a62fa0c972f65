"""The engine's serve loop: load, warm up, report ready, then loop ``core.step()`` for one or more front-ends,
in an engine process of its own (``engine_main``, process_client.py) or on a thread of the server's
(thread_client.py).

Every HTTP front-end process puts its requests on one shared queue (tagged with its index) and reads its
own pipe. Each iteration's outputs are split by owner into one ``StepBatch`` per front-end (flat columns,
step_outputs.py) and handed to that front-end's sender thread: the step loop only appends to the sender's
pending batch, so it never waits on a pipe, and batches a front-end has not taken yet merge into one. With a
sender per front-end, a front-end that falls behind delays nobody else.

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
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from graphserve.config import EngineConfig
from graphserve.engine.core_driver import CoreDriver
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
from graphserve.engine.step_outputs import StepOutputs

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 1.0  # an idle engine blocks on its queue this long, then checks that its parent is alive
# After its last step a GPU engine polls its queue without sleeping for this long before it blocks: a host
# thread that slept wakes slowly (`python3 -m benchmarks.idle_wake`: the `sleep` against the `spin` rows of
# benchmarks/results/idle_wake_llama3-8b.json). On the CPU the engine's own kernels need the cores, so it
# never spins there.
IDLE_SPIN_S = 2.0
# A thread that wants the GIL waits for the holder to release it, at the latest after the switch interval
# (5 ms by default). The step loop runs long pure-Python stretches (scheduling, building a batch's inputs)
# while a sender thread waits to ship the previous step's tokens: 0.5 ms bounds that wait an order tighter.
SWITCH_INTERVAL_S = 0.0005


class Sender:
    """Writes batches to one front-end's pipe on a thread of its own; ``put`` merges into the pending batch
    and returns. Every other engine -> front-end message goes through ``send_message``: one writer thread,
    so messages never interleave on the pipe, and each goes out after the batches put before it."""

    def __init__(self, outbox: Connection, index: int = 0):
        self._outbox = outbox
        self._cond = threading.Condition()
        self._pending: StepBatch | None = None
        self._messages: list[Any] = []
        self._closed = False
        self.broken = False  # this front-end is gone
        self._thread = threading.Thread(target=self._run, name=f"graphserve-engine-sender-{index}", daemon=True)
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


def client_rid(engine_id: str) -> str:
    """The client's rid of an engine id (front-ends name requests ``rid#serial``)."""
    return engine_id.rsplit("#", 1)[0]


class OutputRouter:
    """Which front-end owns each request, and which client rids are in flight across all of them."""

    def __init__(self, num_frontends: int):
        self.num_frontends = num_frontends
        self.owners: dict[str, int] = {}
        self.clients: dict[str, str] = {}  # client rid -> engine id, over every front-end
        self.reported: set[str] = set()  # requests whose first-seen facts went out

    def admit(self, msg: AddRequests, refused: list[list[tuple[str, str]]]) -> list[Any]:
        """The requests of ``msg`` to add; one whose client rid is in flight (sent by another front-end: each
        checks its own) is refused into ``refused[front-end]`` as (engine id, reason)."""
        taken = []
        for req in msg.requests:
            rid = client_rid(req.request_id)
            if rid in self.clients:
                refused[msg.frontend].append(
                    (req.request_id, f"rid={rid!r} is invalid: a request with this id is in flight"))
                continue
            self.clients[rid] = req.request_id
            self.owners[req.request_id] = msg.frontend
            taken.append(req)
        return taken

    def forget(self, engine_id: str) -> None:
        self.owners.pop(engine_id, None)
        rid = client_rid(engine_id)
        if self.clients.get(rid) == engine_id:
            del self.clients[rid]

    def split(self, outputs: list[Any], failed: dict[str, str], refused: list[list[tuple[str, str]]]
              ) -> list[tuple[StepOutputs, dict[str, str]]]:
        """One (rows, failed) per front-end. Rows of a request nobody owns (aborted) go to front-end 0, which
        drops them as it does any late row."""
        n = self.num_frontends
        groups: list[list[Any]] = [[] for _ in range(n)]
        owners = self.owners
        for co in outputs:
            groups[owners.get(co.request_id, 0) if n > 1 else 0].append(co)
            if co.finish_reason is not None:
                self.forget(co.request_id)
        out = []
        for fe in range(n):
            flat = StepOutputs()
            if groups[fe]:
                flat.add_core_outputs(groups[fe], self.reported)
            for engine_id, reason in refused[fe]:
                flat.add_error(engine_id, reason, param="rid")
            out.append((flat, {}))
        for engine_id, reason in failed.items():
            out[owners.get(engine_id, 0) if n > 1 else 0][1][engine_id] = reason
            self.forget(engine_id)
        self.reported.difference_update(failed)
        return out


def engine_main(config: EngineConfig, inbox: Any, outboxes: list[Connection], log_level: int,
                log_format: str | None, queued: Any) -> None:
    """The engine process: serve its front-ends (``run_engine``) until Shutdown, or until none is left."""
    logging.basicConfig(level=log_level, format=log_format or logging.BASIC_FORMAT, force=True)
    # Ctrl-C (and a service manager's SIGTERM) reach the whole process group: the server drains its requests,
    # then sends Shutdown. A server that dies without doing so is noticed through the queue and the pipes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    senders = [Sender(outbox, i) for i, outbox in enumerate(outboxes)]
    try:
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
        for sender, (flat, fails) in zip(senders, router.split(outputs, failed, refused)):
            sender.put(StepBatch(flat, fails, stats, list(batch_records)))  # own list: batches merge in place


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
