"""Where the serve loop's outputs go: a ``Sender`` per front-end, and the ``OutputRouter`` that splits each
iteration's outputs by the front-end that owns each request (serve_loop.py).

Each iteration's outputs are split by owner into one ``StepBatch`` per front-end (flat columns,
step_outputs.py) and handed to that front-end's sender thread: the step loop only appends to the sender's
pending batch, so it never waits on a pipe, and batches a front-end has not taken yet merge into one. With a
sender per front-end, a front-end that falls behind delays nobody else.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from typing import Any

from graphserve.engine.messages import AddRequests, StepBatch
from graphserve.engine.step_outputs import StepOutputs


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
