"""Which Triton kernels compile after the server said ready, and why.

The warm-up (engine/warmup.py) runs every step shape the scheduler can produce, so that no request after
/health says 200 waits for the compiler. Whether it did is checked here, in service: ``CompileWatch``
records every specialization compiled while the engine loads and warms up, and after ``ready()`` reports
each new one with the arguments whose specialization (type, constant value, divisibility or alignment) sets
it apart from the nearest earlier one of the same kernel, which names the shape the warm-up missed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class CompileWatch:
    """Every Triton kernel specialization this process compiles, by kernel. Installed before the warm-up;
    after ``ready()`` each new one calls ``on_late(kernel, difference)``, the difference naming the arguments
    whose specialization (type, constant value, divisibility or alignment) sets it apart from the nearest
    one compiled before, which says which shape the warm-up missed."""

    def __init__(self, on_late: Callable[[str, str], None]):
        import triton

        self.on_late = on_late
        self.seen: dict[str, list[dict[str, str]]] = {}
        self.is_ready = False
        self._knobs = triton.knobs.runtime
        self._previous = self._knobs.jit_post_compile_hook  # put back by close()
        self._knobs.jit_post_compile_hook = self._hook

    def ready(self) -> None:
        self.is_ready = True

    def close(self) -> None:
        """Put back the hook that was there before (if this watch's is still the one installed)."""
        if self._knobs.jit_post_compile_hook == self._hook:
            self._knobs.jit_post_compile_hook = self._previous

    def _hook(self, *, fn: Any, compile: dict[str, Any], **kwargs: Any) -> Any:
        spec = specialization(compile)
        earlier = self.seen.setdefault(fn.name, [])
        if self.is_ready:
            self.on_late(fn.name, difference(spec, earlier))
        earlier.append(spec)
        if self._previous is not None:  # a hook installed before this watch still sees every compile
            return self._previous(fn=fn, compile=compile, **kwargs)
        return None


def specialization(compile: dict[str, Any]) -> dict[str, str]:
    """Argument name -> how Triton specialized it (``i32 %16``, ``*bf16``, ``constexpr=1``), from the
    post-compile hook's ``specialization_data``."""
    try:
        data = json.loads(compile["specialization_data"])
        names = list(data["signature"])
        out = {name: str(kind) for name, kind in data["signature"].items()}
        for path, value in zip(data["constant_keys"], data["constant_vals"]):
            out[names[path[0]]] += f"={value}" if len(path) == 1 else f"[{path[1:]}]={value}"
        for path, attrs in zip(data["attrs_keys"], data["attrs_vals"]):
            marks = " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in attrs)
            out[names[path[0]]] += f" {marks}" if len(path) == 1 else f" [{path[1:]}] {marks}"
        return out
    except (KeyError, IndexError, TypeError, ValueError):  # another Triton's format: the raw key
        return {"key": str(compile.get("key"))}


def difference(spec: dict[str, str], earlier: list[dict[str, str]]) -> str:
    """``name: before -> now`` for each argument that differs from the nearest earlier specialization."""
    if not earlier:
        return "its first specialization"
    nearest = min(earlier, key=lambda e: sum(e.get(k) != v for k, v in spec.items()))
    changed = [f"{k}: {nearest.get(k)} -> {v}" for k, v in spec.items() if nearest.get(k) != v]
    return "; ".join(changed) or "the same arguments (options differ)"


def watch_compiles(config: Any) -> CompileWatch | None:
    """A GPU engine's compile watch, installed before the engine is built (its graph capture compiles too);
    each compile after ``ready()`` logs a warning naming the kernel and what differs. None on the CPU, where
    nothing compiles."""
    import torch

    if config.device == "cpu" or not torch.cuda.is_available():
        return None
    return CompileWatch(log_late_compile)


def log_late_compile(name: str, difference: str) -> None:
    """The warning line of a compile after ready (`graphserve doctor` finds it in a server log)."""
    logger.warning("kernel %s compiled after ready, a specialization the warm-up did not reach (%s)", name,
                   difference)
