"""One serving iteration of the EngineCore: admit requests, apply aborts, step, and contain faults.

The server drives the core through this from wherever the core lives: a thread of the server process or
the engine process. A fault fails the requests it concerns and leaves the core serving the others.
"""

from __future__ import annotations

import logging
from typing import Any

from graphserve.errors import GraphserveError

logger = logging.getLogger(__name__)

# Test-only: a request whose prompt contains this marker makes the next engine step raise.
FAULT_ENV = "GRAPHSERVE_FAULT_INJECT"


class InjectedFault(RuntimeError):
    def __init__(self, request_ids: set[str]):
        super().__init__(f"injected engine fault for {sorted(request_ids)}")
        self.request_ids = set(request_ids)


class CoreDriver:
    """Owns the core and the ids it holds; used by one thread only (the core has no locks)."""

    def __init__(self, core: Any):
        self.core = core
        self._in_core: set[str] = set()
        self._faulty: set[str] = set()  # ids whose next step raises InjectedFault
        self.profiler: Any = None  # engine/step_profiler.StepProfiler while `graphserve profile` runs

    def flush_prefix_cache(self) -> None:
        dropped = self.core.block_manager.reset_prefix_cache()
        logger.info("prefix cache flushed: %d cached block(s) dropped", dropped)

    def has_work(self) -> bool:
        return bool(self.core.has_unfinished_requests())

    def iterate(self, new: list[Any], aborts: list[str], faulty: set[str] = frozenset()
                ) -> tuple[list[Any], dict[str, str]]:
        """Admit ``new``, apply ``aborts``, run one step; returns (core outputs, failed id -> reason)."""
        self._faulty |= faulty
        try:
            return self._iteration(new, aborts)
        except Exception as exc:  # noqa: BLE001 - outside a step: fail what the core holds, keep serving
            failed = self._fail(exc)
            failed.update({r.request_id: f"{type(exc).__name__}: {exc}" for r in new})
            return [], failed

    def _iteration(self, new: list[Any], aborts: list[str]) -> tuple[list[Any], dict[str, str]]:
        failed: dict[str, str] = {}
        for req in new:
            try:
                self.core.add_request(req)
                self._in_core.add(req.request_id)
            except GraphserveError as exc:
                failed[req.request_id] = exc.message
        if aborts:
            self.core.abort_requests(aborts)
            self._in_core.difference_update(aborts)
            self._faulty.difference_update(aborts)
        outputs: list[Any] = []
        if self.core.has_unfinished_requests():
            try:
                outputs = self._step()
            except Exception as exc:  # noqa: BLE001 - fail the affected requests, keep serving the rest
                failed.update(self._fail(exc))
        return outputs, failed

    def _step(self) -> list[Any]:
        hit = self._faulty & self._in_core
        if hit:
            raise InjectedFault(hit)
        profiler = self.profiler
        outputs = profiler.iteration(self.core.step) if profiler is not None and profiler.active else self.core.step()
        for out in outputs:
            if out.finish_reason is not None:
                self._in_core.discard(out.request_id)
        return outputs

    def _fail(self, exc: Exception) -> dict[str, str]:
        # A fault that names its requests fails only those; any other fault fails what the core held,
        # since its state for them is unknown. Aborting frees their blocks so the pool stays whole.
        ids = set(getattr(exc, "request_ids", ())) or set(self._in_core)
        logger.error("engine step failed (%s: %s); failing %d request(s)", type(exc).__name__, exc, len(ids),
                     exc_info=not isinstance(exc, InjectedFault))
        self._faulty.difference_update(ids)
        try:
            self.core.abort_requests(list(ids))
        except Exception:  # noqa: BLE001
            logger.exception("abort after an engine fault failed")
        self._in_core.difference_update(ids)
        return {rid: f"{type(exc).__name__}: {exc}" for rid in ids}
