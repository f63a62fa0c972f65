"""Where each profiled engine step's time went, read from a torch.profiler Chrome trace.

The step profiler (engine/step_profiler.py) marks every engine iteration (``graphserve.iteration``),
every step launch (``graphserve.launch``) and the sampling, attention and MoE calls (``graphserve.sampling``,
``graphserve.attention``, ``graphserve.moe``) with record_function ranges. A step's work is then:

- on CPU, the outermost aten ops inside its iteration; the rest of the iteration is host time
  (scheduling, input building, Python between ops);
- on CUDA, the kernels and copies whose launch call lies inside its launch range (matched through
  the trace's correlation ids); its span on the device runs from the end of the previous step's
  last kernel to the end of its own, and the part of the span where no kernel of it runs is the gap
  between kernels, i.e. time the GPU waited for the host.

Each piece of work is put in one category (engine/trace_categories.py), by the range it was called from
(sampling, attention), else by its name (NAME_RULES, first match wins). The span's wall time is then shared
among the categories on the timeline, overlapped time split evenly and time no work covers counted as
gaps (``trace_categories.wall_shares``): the categories add up to the span even where kernels overlap
(programmatic dependent launch, several streams). Each category's summed work is kept beside its share.
The chrome trace is used rather than ``prof.events()`` because its layout has stayed the same across
torch versions.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphserve.engine.trace_categories import ITERATION, LAUNCH, SCOPES, WORK_CATEGORIES, classify, wall_shares

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class _Ev:
    name: str
    ts: float  # µs
    dur: float
    tid: Any = None
    corr: int | None = None

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass
class StepBreakdown:
    """One step: wall ms per category (``gaps_host`` included), which add up to ``span_ms``; summed work per
    category (``busy_ms``, overlaps counted once per kernel); the time two or more kernels ran at once."""

    categories_ms: dict[str, float]
    span_ms: float  # what the categories add up to: the iteration (CPU) or the device span (CUDA)
    kernels: int
    kernel_ms: dict[str, float] = field(default_factory=dict)  # summed work by name
    busy_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WORK_CATEGORIES, 0.0))
    overlapped_ms: float = 0.0


def _ranges(events: Sequence[Mapping[str, Any]]) -> dict[str, list[_Ev]]:
    out: dict[str, list[_Ev]] = {"iteration": [], "launch": [], "scope": [], "cpu_op": [], "device": [],
                                 "runtime": []}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        ev = _Ev(name, float(e["ts"]), float(e["dur"]), e.get("tid"), (e.get("args") or {}).get("correlation"))
        if cat == "user_annotation":
            if name == ITERATION:
                out["iteration"].append(ev)
            elif name == LAUNCH:
                out["launch"].append(ev)
            elif name in SCOPES:
                out["scope"].append(ev)
        elif cat == "cpu_op":
            out["cpu_op"].append(ev)
        elif cat in DEVICE_CATS:
            out["device"].append(ev)
        elif cat in ("cuda_runtime", "cuda_driver", "runtime"):
            out["runtime"].append(ev)
    for v in out.values():
        v.sort(key=lambda x: (x.ts, -x.dur))
    return out


def _scope_at(scopes: list[_Ev], starts: list[float], t: float) -> str | None:
    """The scope range holding time ``t``: sampling, attention and MoE calls never nest in each other, so it
    is the last one starting at or before ``t``, if it has not ended."""
    i = bisect.bisect_right(starts, t) - 1
    return SCOPES[scopes[i].name] if i >= 0 and t <= scopes[i].end else None


def _top_level(ops: list[_Ev]) -> list[_Ev]:
    """Ops not inside another op of the same thread (their children would count twice)."""
    out: list[_Ev] = []
    end_by_tid: dict[Any, float] = {}
    for op in ops:
        if op.ts < end_by_tid.get(op.tid, float("-inf")) - 1e-3:
            continue
        out.append(op)
        end_by_tid[op.tid] = op.end
    return out


def breakdown(events: Sequence[Mapping[str, Any]], device: str) -> list[StepBreakdown | None]:
    """One entry per launch range in the trace, in launch order: its StepBreakdown, or None where it
    cannot be measured (no iteration around it; on CUDA no work, or no previous step to start from)."""
    r = _ranges(events)
    return _cpu_steps(r) if device == "cpu" else _device_steps(r)


def unmatched_device_work(events: Sequence[Mapping[str, Any]]) -> int:
    """Kernels and copies, run after the first traced step's work, whose launch call is not in the trace:
    no step can claim them, so their time shows up as gaps. Nonzero means this torch/CUPTI records some
    launch calls elsewhere (or not at all). Work before that is the step launched before the trace began."""
    per_step, unmatched = _match(_ranges(events))
    first_end = next((max(ev.end for ev, _ in work) for work in per_step if work), None)
    return 0 if first_end is None else sum(1 for ev in unmatched if ev.ts >= first_end)


def _match(r: dict[str, list[_Ev]]) -> tuple[list[list[tuple[_Ev, str | None]]], list[_Ev]]:
    """Device work per launch range (with the scope its call was made in), and the work matched to none."""
    scopes = r["scope"]
    scope_starts = [s.ts for s in scopes]
    launches = r["launch"]
    launch_starts = [x.ts for x in launches]
    call_ts = {ev.corr: ev.ts for ev in r["runtime"] if ev.corr is not None}
    per_step: list[list[tuple[_Ev, str | None]]] = [[] for _ in launches]
    unmatched = []
    for ev in r["device"]:
        t = call_ts.get(ev.corr)
        k = -1 if t is None else bisect.bisect_right(launch_starts, t) - 1
        if k >= 0 and t <= launches[k].end:
            per_step[k].append((ev, _scope_at(scopes, scope_starts, t)))
        elif t is None:
            unmatched.append(ev)
    return per_step, unmatched


def _step(work: Sequence[tuple[_Ev, str]], lo: float, hi: float, kernels: int) -> StepBreakdown:
    """``work``'s (event, category) on the timeline ``[lo, hi]`` (µs), in ms."""
    shares = wall_shares(((ev.ts, ev.end, cat) for ev, cat in work), lo, hi)
    by_name: dict[str, float] = {}
    for ev, _ in work:
        by_name[ev.name] = by_name.get(ev.name, 0.0) + max(0.0, min(ev.end, hi) - max(ev.ts, lo)) / 1e3
    return StepBreakdown({c: v / 1e3 for c, v in shares.wall.items()}, (hi - lo) / 1e3, kernels, by_name,
                         {c: v / 1e3 for c, v in shares.busy.items()}, shares.overlapped / 1e3)


def _cpu_steps(r: dict[str, list[_Ev]]) -> list[StepBreakdown | None]:
    scopes = r["scope"]
    scope_starts = [s.ts for s in scopes]
    iters = r["iteration"]
    tid = iters[0].tid if iters else None
    ops = _top_level([o for o in r["cpu_op"] if o.tid == tid])
    starts = [o.ts for o in ops]
    steps: list[StepBreakdown | None] = []
    for launch in r["launch"]:
        it = next((i for i in iters if i.ts <= launch.ts <= i.end), None)
        if it is None:
            steps.append(None)
            continue
        lo, hi = bisect.bisect_left(starts, it.ts), bisect.bisect_right(starts, it.end)
        work = [(op, classify(op.name, _scope_at(scopes, scope_starts, op.ts))) for op in ops[lo:hi]]
        steps.append(_step(work, it.ts, it.end, hi - lo))
    return steps


def _device_steps(r: dict[str, list[_Ev]]) -> list[StepBreakdown | None]:
    per_step, _ = _match(r)
    steps: list[StepBreakdown | None] = []
    prev_end = None
    for work in per_step:
        end = max((ev.end for ev, _ in work), default=None)
        if not work or prev_end is None:  # no previous end, no span
            steps.append(None)
            prev_end = end
            continue
        kernels = sum(1 for ev, _ in work if not ev.name.lower().startswith("memcpy"))
        # a kernel launched early (PDL) may start before the previous step's last one ends: only what falls
        # inside this step's span is its own
        steps.append(_step([(ev, classify(ev.name, scope)) for ev, scope in work], prev_end, end, kernels))
        prev_end = end
    return steps
