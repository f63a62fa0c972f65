"""Where the serve loop's outputs go: a ``Sender`` per front-end, and the ``OutputRouter`` that splits each
iteration's outputs by the front-end that owns each request (serve_loop.py).

Each iteration's outputs are split by owner into one ``StepBatch`` per front-end (flat columns,
step_outputs.py) and handed to that front-end's sender. While the front-end keeps up, the step loop writes the
batch to the pipe itself, without blocking (its write end is non-blocking); only what the pipe has no room for
goes to the sender's thread, and batches put while the thread still writes merge into one. So the step loop
never waits on a pipe, and with a sender per front-end, a front-end that falls behind delays nobody else.

Writing on the step loop's thread is what keeps a server's engine as fast as an offline one: a sender thread
woken every step took the GIL from the step loop twice a step. On CPU with 64 decoding requests that thread used
0.21 ms of CPU a step and kept the step loop off the CPU 0.12 ms a step, and the server's engine took 1.24x the
offline engine's time per step; writing inline, 0.82x (`python3 -m benchmarks.serve_host`: results/serve_host.json
and serve_host_before.json).
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import threading
from multiprocessing.connection import Connection
from typing import Any

from graphserve.engine.messages import AddRequests, StepBatch
from graphserve.engine.step_outputs import StepOutputs


def frame(message: Any) -> bytes:
    """``message`` as ``Connection.send`` puts it on the wire (a length header, then the pickle), so the front-end
    reads it with ``Connection.recv``."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    n = len(data)
    return (struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)) + data


class Sender:
    """Sends to one front-end's pipe: ``put`` a step's batch, ``send_message`` anything else, in order.

    With nothing queued, the caller pickles and writes the message at once. A write the pipe has no room for
    (the front-end is behind) leaves its unwritten tail to the sender's thread, which waits for room; until
    that thread has written everything it holds, ``put`` merges into its pending batch and ``send_message``
    queues behind it, so messages keep their order and never interleave on the pipe."""

    def __init__(self, outbox: Connection, index: int = 0):
        self._outbox = outbox  # held: the Connection owns the descriptor written below
        self._fd = outbox.fileno()
        os.set_blocking(self._fd, False)  # a full pipe must not stop the step loop
        self._cond = threading.Condition()
        self._pending: StepBatch | None = None
        self._messages: list[Any] = []
        self._tail: memoryview | None = None  # the unwritten end of a frame the pipe had no room for
        self._writing = False  # the thread writes outside the lock
        self._closed = False
        self.broken = False  # this front-end is gone
        self._thread = threading.Thread(target=self._run, name=f"graphserve-engine-sender-{index}", daemon=True)
        self._thread.start()

    def _backlog(self) -> bool:
        return self._pending is not None or bool(self._messages) or self._tail is not None or self._writing

    def put(self, batch: StepBatch) -> None:
        with self._cond:
            if not self._backlog():
                self._write_now(batch)
            elif self._pending is None:
                self._pending = batch
                self._cond.notify()
            else:
                self._pending.merge(batch)

    def send_message(self, message: Any) -> None:
        with self._cond:
            if not self._backlog():
                self._write_now(message)
                return
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

    def _write_now(self, message: Any) -> None:
        """Under the lock, nothing queued: write what the pipe takes now, leave the rest to the thread."""
        if self.broken:
            return
        data = frame(message)
        try:
            written = os.write(self._fd, data)
        except BlockingIOError:
            written = 0
        except OSError:  # BrokenPipeError, ConnectionResetError: the front-end is gone
            self.broken = True
            return
        if written < len(data):
            self._tail = memoryview(data)[written:]
            self._cond.notify()

    def _write_all(self, data: memoryview) -> None:
        """Write all of ``data``, waiting (GIL released) for room whenever the pipe is full."""
        poller = None
        while data:
            try:
                data = data[os.write(self._fd, data):]
            except BlockingIOError:
                if poller is None:
                    poller = select.poll()  # not select.select: an engine's descriptors may pass FD_SETSIZE
                    poller.register(self._fd, select.POLLOUT)
                poller.poll()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._backlog() and not self._closed:
                    self._cond.wait()
                tail, self._tail = self._tail, None
                out, self._messages = self._messages, []
                if self._pending is not None:
                    out.append(self._pending)
                    self._pending = None
                if tail is None and not out:
                    return
                self._writing = True
            try:
                if tail is not None:
                    self._write_all(tail)
                for message in out:
                    self._write_all(memoryview(frame(message)))
            except OSError:
                self.broken = True
                return
            finally:
                with self._cond:
                    self._writing = False


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
