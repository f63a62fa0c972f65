"""A stand-in engine process for tests of the server's process handling: it serves nothing and exits 0 as
soon as it is told to shut down (spawned by name, so it lives in an importable module)."""

from __future__ import annotations

from typing import Any


def idle_engine(config: Any, inbox: Any, outboxes: Any, log_level: int, log_format: str | None, queued: Any) -> None:
    from graphserve.engine.process_client import Shutdown

    while not isinstance(inbox.get(), Shutdown):
        pass
