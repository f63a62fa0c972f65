"""Shared helpers for the GPU benchmarks: device ceilings, timing, result files."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    """The commit measured: $GRAPHSERVE_COMMIT (set it where the tree travels without .git), else git."""
    if os.environ.get("GRAPHSERVE_COMMIT"):
        return os.environ["GRAPHSERVE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except Exception:
        return "unknown"


def environment() -> dict:
    env = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def write_result(name: str, payload: dict) -> Path:
    """Write benchmarks/results/NAME.json (and a copy under $OUT when set, so it comes back from the GPU)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(), **payload}
    text = json.dumps(payload, indent=1)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, f"{name}.json").write_text(text)
    return path


def merge_rows(name: str, rows: list[dict], **tables) -> Path:
    """Write ``rows`` into benchmarks/results/NAME.json beside the rows already there: a row replaces the earlier
    row of its case (model, batch size, context), every other row stays, so a run that measures a model at fewer
    batch sizes than the file holds keeps the others, each naming its run. ``tables`` replace the file's
    other keys of those names, but for a table of per-model entries (a list of dicts, each with a ``model``),
    which merges as the rows do (an empty one keeps the file's; an old entry naming no model goes). The file's
    environment becomes this run's, so every row names the run that measured it (``measured_at``); rows from
    before carry the environment of the file they came from."""
    path = RESULTS_DIR / f"{name}.json"
    payload = json.loads(path.read_text()) if path.exists() else {}
    before = payload.pop("environment", {})  # write_result records this run's
    now = environment()

    def case(r: dict) -> tuple:
        return r["model"], r.get("bs"), r.get("ctx")

    def merged(old: list, new: list) -> list:
        cases = {case(r) for r in new}
        kept = [{"measured_at": before, **r} for r in old if "model" in r and case(r) not in cases]
        return kept + [{**r, "measured_at": now} for r in new]

    for key, table in tables.items():
        per_model = isinstance(table, list) and all(isinstance(r, dict) and "model" in r for r in table)
        payload[key] = merged(payload.get(key, []), table) if per_model else table
    payload["rows"] = merged(payload.get("rows", []), rows)
    return write_result(name, payload)


class PrefillProbe:
    """Runs one-token requests through an ``LLM`` and times each two ways: the whole ``generate`` call (ms)
    and its prefill step's own ``step_ms`` from the engine's telemetry ring, the engine's own prefill time."""

    def __init__(self, llm):
        from graphserve import SamplingParams

        self.llm = llm
        self.one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def __call__(self, prompt: list[int]) -> tuple[float, float]:
        telemetry = self.llm.engine.core.telemetry
        last = telemetry.last_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": prompt}], self.one, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_ms = 1000 * (time.perf_counter() - t0)
        return wall_ms, sum(r.step_ms for r in telemetry.records() if r.step > last and r.prefill_tokens > 0)


def cuda_time_ms(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median wall time of ``fn()`` in ms, measured with CUDA events (GPU) or perf_counter (CPU)."""
    import statistics

    return statistics.median(cuda_times_ms(fn, warmup, iters))


def cuda_times_ms(fn, warmup: int = 3, iters: int = 20) -> list[float]:
    """Each of ``iters`` timed calls of ``fn()`` in ms (CUDA events on a GPU, perf_counter on CPU)."""
    import time

    for _ in range(warmup):
        fn()
    times = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def median_difference_ci(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of median(a) - median(b): the resolution of a difference of two medians."""
    import random
    import statistics

    rng = random.Random(seed)
    diffs = sorted(statistics.median(rng.choices(a, k=len(a))) - statistics.median(rng.choices(b, k=len(b)))
                   for _ in range(resamples))
    return diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = [max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in cols]  # no rows: the header alone
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(cols, widths)))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)
