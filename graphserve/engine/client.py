"""How a front-end talks to the engine, wherever the engine runs: the ``EngineClient`` protocol.

Two clients implement it: ``ThreadClient`` runs the engine's serve loop (serve_loop.py) on a thread of the
front-end's process (``--engine-in-process``), ``ProcessClient`` talks to it in an engine process, which it
owns or shares with other front-ends (``--api-server-count N``). Either way the same messages (messages.py)
go in, and what the engine says comes back, on a thread of the client's, to the ``on_message`` the client
was built with: ``EngineReady`` or ``EngineLoadFailed`` once, then a ``StepBatch`` of outputs per iteration
(or several merged), and ``ProfileSteps`` answers. An exit the front-end did not ask for goes to ``on_exit``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from graphserve.engine.messages import AbortRequests, AddRequests, FlushPrefixCache, ProfileSteps
from graphserve.engine.request import EngineRequest

OnMessage = Callable[[Any], None]  # EngineReady | EngineLoadFailed | StepBatch | ProfileSteps
OnExit = Callable[[int | None], None]  # the exit code, where there is one


class SharedCount(Protocol):
    """A counter several threads or processes change under its lock (``multiprocessing.Value`` has this shape)."""

    value: int

    def get_lock(self) -> Any: ...


class EngineClient(Protocol):
    frontend: int  # which front-end this is: the outputs of its requests come back to it alone
    # sequences sent by any front-end that the engine has not scheduled yet: the --max-queued-requests bound
    queued: SharedCount

    @property
    def alive(self) -> bool:
        """Started, and the engine has not exited."""

    def start(self) -> None: ...

    def add(self, requests: list[EngineRequest], faulty: set[str] = ...) -> None:
        """Queue validated requests (``faulty``: test-only, ids whose next step raises)."""

    def abort(self, request_ids: list[str]) -> None: ...

    def flush_cache(self) -> None:
        """Drop the prefix cache before the engine's next step."""

    def profile(self, msg: ProfileSteps) -> None:
        """Profile the engine's next decode steps; the answer comes back as a ProfileSteps message."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop sending; stop the engine if this client owns it. Idempotent."""


class MessageClient:
    """The requests of the protocol as messages onto the client's ``_inbox`` (a queue the engine side drains), none
    once the client is stopping; a client supplies ``_inbox``, ``_stopping`` and ``frontend``."""

    frontend: int
    _inbox: Any
    _stopping: bool

    def send(self, message: Any) -> None:
        if not self._stopping:
            self._inbox.put(message)

    def add(self, requests: list[EngineRequest], faulty: set[str] = frozenset()) -> None:
        self.send(AddRequests(requests, set(faulty), frontend=self.frontend))

    def abort(self, request_ids: list[str]) -> None:
        self.send(AbortRequests(request_ids))

    def flush_cache(self) -> None:
        self.send(FlushPrefixCache())

    def profile(self, msg: ProfileSteps) -> None:
        msg.frontend = self.frontend
        self.send(msg)
