"""Profile the next N decode steps of a live engine with torch.profiler: where does a step go?

The serving loop hands each engine iteration to ``StepProfiler.iteration`` while a profile runs
(engine/core_driver.py; `graphserve profile --model` drives a core itself). Phases, in order:

- ``graph``: the steps as they run (CUDA graphs replayed), when the engine captured graphs;
- ``eager``: the same requests with graph replay switched off (runner.graphs set aside), after a few
  unprofiled warm-up steps. The memory plan already reserves the eager decode batch's activations.

Each phase traces ``steps`` + 2 decode steps, then runs one untraced iteration so that the last traced
step's telemetry record (its measured step time) arrives. On CUDA the first traced step only gives the
next one its start. The last one's record is disturbed with the overlap schedule: a step's time runs
from its predecessor's ids to its own, so the last traced step's time holds the profiler's stop and
trace export (75 ms against 4.6 ms steps for llama3-8b at batch 1 on an H200, which made the mean
step 11.7 ms). Every record whose interval overlaps the profiler's own bookkeeping (start, stop,
export) is therefore kept out of the step statistics and listed apart with the reason; the phase
reports the mean, median and range of the steps that remain.

With the overlap schedule and a host-bound step (eager), a step's record is mostly the host's work on
the next step, so a per-step row pairs a device span with its neighbour's host time; over the phase's
window the means and medians agree.

The trace is read by engine/step_trace.py: each step's categories are its wall time on the timeline, where
overlapping kernels (programmatic dependent launch) share the time they overlap, so they add up to the
span; ``busy_ms`` keeps each category's summed kernel time. Some torch/CUDA versions do not show the
kernels inside a graph replay; then the graph phase's kernel times come from the eager phase (the same
kernels on the same batch) and its gaps are its measured step time minus them; the result says so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from graphserve.engine.step_trace import breakdown, unmatched_device_work
from graphserve.engine.trace_categories import CATEGORIES, GAPS, ITERATION, LAUNCH, WORK_CATEGORIES

logger = logging.getLogger(__name__)

EAGER_WARMUP_STEPS = 3
# A graph phase that shows fewer kernels than this share of the eager phase's did not see the replays.
GRAPH_VISIBLE_SHARE = 0.5
TOP_KERNELS = 12
# Routed-expert layers: all their work (routing, sort/align, grouped GEMMs, and on CPU the reference loop
# of per-expert matmuls) is MoE time, whatever its ops are called.
MOE_MODULES = ("FusedMoE",)


class StepProfiler:
    def __init__(self, core: Any, steps: int, on_done: Callable[[dict], None], max_iterations: int | None = None):
        self.core, self.steps, self.on_done = core, steps, on_done
        runner = core.runner
        self.device = runner.device.type
        self.phases = ["graph", "eager"] if runner.graphs is not None else ["eager"]
        self.max_iterations = max_iterations or max(100, 20 * steps)
        self.results: list[dict] = []
        self.cancelled = False
        self.active = True
        self._phase = -1
        self._saved_graphs = None
        self._restore: list[Callable[[], None]] = []
        self._prof: profile | None = None
        self._own_time: list[tuple[float, float]] = []  # wall-clock windows of the profiler's own bookkeeping

    # -- the loop's side -------------------------------------------------------------------------
    def iteration(self, step: Callable[[], Any]) -> Any:
        """Run one engine iteration (``step()``) inside the profile; returns what it returns."""
        if self.cancelled:
            self.close()
            return step()
        if self._phase < 0 and not self._guard(self._start_phase):  # nothing is touched before a step comes
            return step()
        self._iterations += 1
        if self._warmup > 0:  # untraced: eager kernels compile and settle first
            self._warmup -= 1
            out = step()
            if self._warmup == 0:
                self._guard(self._trace_start)
            return out
        if self._prof is None:  # draining: the last traced step's record arrives now
            out = step()
            self._guard(self._finish_phase)
            return out
        with record_function(ITERATION):
            out = step()
        decode = sum(1 for x in self._launches if x["kind"] == "decode")
        if decode >= self.steps + 2 or self._iterations >= self.max_iterations:
            self._guard(self._trace_stop)
        return out

    def _guard(self, bookkeeping: Callable[[], None]) -> bool:
        """Run profiler bookkeeping; a failure ends the profile (and says why to the caller), never the step
        and its requests."""
        start = time.time()
        try:
            bookkeeping()
            return True
        except Exception as exc:  # noqa: BLE001
            logger.exception("the step profile failed")
            self.close()
            self.on_done({"error": f"the profile failed: {type(exc).__name__}: {exc}", "code": 500, "phases": []})
            return False
        finally:
            self._own_time.append((start, time.time()))

    def _disturbed_ms(self, rec: Any) -> float:
        """How much of a step's measured interval the profiler's own bookkeeping took (0: none)."""
        end = rec.time
        begin = end - rec.step_ms / 1e3
        return 1e3 * sum(max(0.0, min(end, b) - max(begin, a)) for a, b in self._own_time)

    def cancel(self) -> None:
        """From another thread: stop at the next iteration, putting the engine back as it was."""
        self.cancelled = True

    def close(self) -> None:
        """From the loop's thread: stop now and put the engine back as it was (graphs, methods)."""
        self._teardown()
        self.active = False

    # -- phases ----------------------------------------------------------------------------------
    def _start_phase(self) -> None:
        self._phase += 1
        self._launches: list[dict] = []
        self._iterations = 0
        mode = self.phases[self._phase]
        self._warmup = EAGER_WARMUP_STEPS if mode == "eager" and self.device == "cuda" else 0
        if mode == "eager" and self.core.runner.graphs is not None:
            self._saved_graphs, self.core.runner.graphs = self.core.runner.graphs, None
        if self._warmup == 0:
            self._trace_start()

    def _trace_start(self) -> None:
        self._hook()
        # A step launched before the trace resolves inside it (overlap schedule): its record is not ours.
        self._skip_records = 1 if self.core.has_step_in_flight else 0
        self._last_step_id = self.core.telemetry.last_step()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self._prof = profile(activities=acts)
        self._prof.start()

    def _trace_stop(self) -> None:
        assert self._prof is not None
        self._prof.stop()
        tmp = tempfile.mkdtemp(prefix="graphserve-profile-")
        try:
            path = os.path.join(tmp, "trace.json")
            self._prof.export_chrome_trace(path)
            with open(path, encoding="utf-8") as f:
                self._events = json.load(f).get("traceEvents", [])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._prof = None
        self._unhook_methods()

    def _finish_phase(self) -> None:
        self._teardown()
        self.results.append(self._summarise(self.phases[self._phase]))
        self._events = []
        if self._phase + 1 < len(self.phases):
            self._start_phase()
            return
        self.active = False
        self.on_done(self._result())

    def _teardown(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
        self._unhook_methods()
        if self._saved_graphs is not None:
            self.core.runner.graphs, self._saved_graphs = self._saved_graphs, None

    # -- hooks: record_function ranges around the calls step_trace reads --------------------------
    def _hook(self) -> None:
        runner = self.core.runner
        self._wrap(runner, "launch", LAUNCH, after=self._on_launch)
        self._wrap(runner.sampler, "sample", "graphserve.sampling")
        for name in ("forward", "attend"):
            self._wrap(runner.attn_backend, name, "graphserve.attention")
        for module in runner.model.modules():
            if type(module).__name__ in MOE_MODULES:
                self._wrap(module, "forward", "graphserve.moe")
        if any(type(m).__name__ == "DsaIndexer" for m in runner.model.modules()):
            self._hook_sparse_attention(runner)

    def _hook_sparse_attention(self, runner: Any) -> None:
        """The DSA functions of the step's backend (kernels/dsa.py or its references), wrapped in their module, where
        the layers and ``indexer_topk`` look them up: none of them calls another wrapped one, so the ranges never
        nest. The indexer's projections and rope stay dense GEMMs and elementwise work."""
        from types import SimpleNamespace

        from graphserve.layers.dsa_indexer import dsa_ops

        ops = dsa_ops(SimpleNamespace(attn_backend=runner.attn_backend))
        for name, label in (("write_index_cache", "graphserve.indexer"), ("indexer_scores", "graphserve.indexer"),
                            ("topk_indices", "graphserve.topk"), ("sparse_mla", "graphserve.attention")):
            self._wrap(ops, name, label)

    def _wrap(self, obj: Any, name: str, label: str, after: Callable[[Any], None] | None = None) -> None:
        inner = getattr(obj, name)
        had = name in vars(obj)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                try:
                    out = inner(*args, **kwargs)
                except BaseException:
                    if after is not None:
                        after(None)
                    raise
            if after is not None:
                after(args[0])
            return out

        setattr(obj, name, wrapped)
        self._restore.append(lambda: setattr(obj, name, inner) if had else delattr(obj, name))

    def _unhook_methods(self) -> None:
        for undo in reversed(self._restore):
            undo()
        self._restore = []

    def _on_launch(self, sched: Any) -> None:
        if sched is None:  # the launch raised: keep the list aligned with the trace's launch ranges
            self._launches.append({"kind": "failed", "batch_size": 0, "mode": ""})
            return
        shape = self.core.runner.last_shape
        self._launches.append({"kind": sched.kind, "batch_size": len(sched.scheduled), "mode": shape.mode,
                               "padded_size": shape.padded_size})

    # -- results ---------------------------------------------------------------------------------
    def _summarise(self, mode: str) -> dict:
        steps = breakdown(self._events, self.device)
        records = [r for r in self.core.telemetry.records() if r.step > self._last_step_id][self._skip_records:]
        rows, excluded = [], []
        for launch, bd, rec in zip(self._launches, steps, records + [None] * len(self._launches)):
            ok = rec is not None and rec.kind == launch["kind"] and rec.batch_size == launch["batch_size"]
            if launch["kind"] != "decode" or bd is None or not ok:
                continue
            own = self._disturbed_ms(rec)
            if own > 0.0:
                excluded.append({"step_ms": rec.step_ms, "span_ms": bd.span_ms, "profiler_ms": own,
                                 "why": "its measured time includes the profiler's own start/stop/export"})
            else:
                rows.append((launch, bd, rec))
        rows = rows[-self.steps:]  # on CPU every traced step is measurable: keep exactly the steps asked for
        out: dict[str, Any] = {"mode": mode, "steps": len(rows)}
        if not rows:
            out["error"] = (f"no decode step could be measured in {self._iterations} iterations "
                            f"({len(self._launches)} launches: {sorted({x['kind'] for x in self._launches})})")
            return out
        mean = statistics.fmean
        step_ms = [rec.step_ms for _, _, rec in rows]
        out.update({
            "batch_size": int(statistics.median(x["batch_size"] for x, _, _ in rows)),
            "run_as": sorted({x["mode"] for x, _, _ in rows}),
            "step_ms": mean(step_ms),
            "step_ms_median": statistics.median(step_ms),
            "step_ms_range": [min(step_ms), max(step_ms)],
            "span_ms": mean(bd.span_ms for _, bd, _ in rows),
            "span_ms_median": statistics.median(bd.span_ms for _, bd, _ in rows),
            "categories_ms": {c: mean(bd.categories_ms.get(c, 0.0) for _, bd, _ in rows) for c in CATEGORIES},
            "busy_ms": {c: mean(bd.busy_ms.get(c, 0.0) for _, bd, _ in rows) for c in WORK_CATEGORIES},
            "overlapped_ms": mean(bd.overlapped_ms for _, bd, _ in rows),
            "kernels_per_step": mean(bd.kernels for _, bd, _ in rows),
            # each step's own categories: `sweep --breakdown` fits them against the batch size step by step
            "per_step": [{"step_ms": rec.step_ms, "span_ms": bd.span_ms, "batch_size": rec.batch_size,
                          "categories_ms": {c: bd.categories_ms.get(c, 0.0) for c in CATEGORIES}}
                         for _, bd, rec in rows],
            "attribution": "measured",
            "excluded_steps": excluded,
        })
        names: dict[str, float] = {}
        for _, bd, _ in rows:
            for k, v in bd.kernel_ms.items():
                names[k] = names.get(k, 0.0) + v / len(rows)
        if self.device == "cuda":
            out["unmatched_device_work"] = unmatched_device_work(self._events)
        out["top_kernels"] = [{"name": k[:120], "ms": v} for k, v in sorted(names.items(), key=lambda kv: -kv[1])
                              [:TOP_KERNELS]]
        return out

    def _result(self) -> dict:
        notes = []
        if self.device == "cpu":
            notes.append("CPU: no CUDA graphs, so the step runs eagerly and only the eager phase is shown; "
                         "work is the outermost aten ops, the rest of each iteration is host time")
        elif "graph" not in self.phases:
            notes.append("the engine captured no CUDA graphs (--disable-cuda-graph?): eager phase only")
        for p in self.results:
            if p.get("unmatched_device_work"):
                notes.append(f"{p['mode']}: {p['unmatched_device_work']} kernels/copies in the trace had no launch call "
                             "to match them to a step; their time is counted as gaps")
        for p in self.results:
            if p.get("excluded_steps"):
                own = max(x["profiler_ms"] for x in p["excluded_steps"])
                notes.append(f"{p['mode']}: {len(p['excluded_steps'])} step(s) kept out of the step time: their "
                             f"measured time includes the profiler's own start/stop/export (up to {own:.1f} ms)")
        by_mode = {p["mode"]: p for p in self.results}
        graph, eager = by_mode.get("graph"), by_mode.get("eager")
        if graph and eager and "error" not in graph and "error" not in eager:
            if graph["kernels_per_step"] < GRAPH_VISIBLE_SHARE * eager["kernels_per_step"]:
                seen = graph["kernels_per_step"]
                cats = {c: eager["categories_ms"][c] for c in WORK_CATEGORIES}
                cats[GAPS] = max(0.0, graph["step_ms"] - sum(cats.values()))
                graph.update({"categories_ms": cats, "span_ms": max(graph["step_ms"], sum(cats.values())),
                              "busy_ms": eager["busy_ms"], "overlapped_ms": eager["overlapped_ms"],
                              "attribution": "eager", "kernels_seen_per_step": seen,
                              "top_kernels": eager["top_kernels"]})
                notes.append(f"the profiler saw {seen:.0f} kernels per graph replay step against "
                             f"{eager['kernels_per_step']:.0f} eager (torch {torch.__version__} hides kernels "
                             "inside CUDA graphs): the graph phase's kernel times are the eager phase's on the "
                             "same batch, and its gaps are its measured step time minus them")
                if sum(cats.values()) > graph["step_ms"]:
                    notes.append(f"the eager phase's kernels cover {sum(cats.values()):.3f} ms, more than the "
                                 f"replayed step's {graph['step_ms']:.3f} ms: the graph phase's shares are of the "
                                 "former")
        for p in self.results:
            if "categories_ms" in p:  # shares of the step's wall time on its timeline: they add up to 100
                p["categories_pct"] = {c: 100.0 * v / p["span_ms"] for c, v in p["categories_ms"].items()}
        cuda = self.device == "cuda" and torch.cuda.is_available()
        card = torch.cuda.get_device_name(self.core.runner.device) if cuda else self.device  # what measured it
        return {"device": self.device, "card": card, "model": self.core.config.model, "steps_requested": self.steps,
                "torch": torch.__version__, "phases": self.results, "notes": notes}
