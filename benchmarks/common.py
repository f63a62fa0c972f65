"""Shared helpers for the GPU benchmarks: device ceilings, timing, result files."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from graphserve.tuning.timing import (  # noqa: F401  (re-exported: the benchmarks import them from here)
    RATIO_WORDS,
    _fmt,
    cuda_time_ms,
    cuda_times_ms,
    environment,
    git_commit,
    is_ratio_column,
    print_table,
    ratio_text,
    start_run,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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


def merge_rows(name: str, rows: list[dict], ceilings: dict | None = None, case_fields: tuple[str, ...] = ("bs", "ctx"),
               **tables) -> Path:
    """Write ``rows`` into benchmarks/results/NAME.json beside the rows already there: a row replaces the earlier
    row of its case (its model and ``case_fields``, by default batch size and context), every other row stays, so a
    run that measures a model at fewer batch sizes than the file holds keeps the others, each naming its run. A file
    whose rows differ in other fields (a server row and an offline row of one model) names them in ``case_fields``.
    ``tables`` replace the file's
    other keys of those names, but for a table of per-model entries (a list of dicts, each with a ``model``),
    which merges as the rows do (an empty one keeps the file's; an old entry naming no model goes). The file's
    environment becomes this run's, so every row names the run that measured it (``measured_at``, with its
    ``run_id``); rows from before carry the environment of the file they came from.

    ``ceilings`` (the read bandwidth and matmul peaks this run divided by) join the file's ceilings of earlier
    runs, one entry a run (``run_ceilings``), and an entry whose run has no row left in the file goes: each row's
    denominators stay beside it however many runs the file merges (``ceilings_for``)."""
    path = RESULTS_DIR / f"{name}.json"
    payload = json.loads(path.read_text()) if path.exists() else {}
    before = payload.pop("environment", {})  # write_result records this run's
    now = environment()
    kept_ceilings = run_ceilings(payload.pop("ceilings", None), before)

    def case(r: dict) -> tuple:
        return r["model"], *(r.get(f) for f in case_fields)

    def merged(old: list, new: list) -> list:
        cases = {case(r) for r in new}
        kept = [{"measured_at": before, **r} for r in old if "model" in r and case(r) not in cases]
        return kept + [{**r, "measured_at": now} for r in new]

    for key, table in tables.items():
        per_model = isinstance(table, list) and all(isinstance(r, dict) and "model" in r for r in table)
        payload[key] = merged(payload.get(key, []), table) if per_model else table
    payload["rows"] = merged(payload.get("rows", []), rows)
    if ceilings is not None:
        kept_ceilings[run_key(now)] = {"measured_at": now, **ceilings}
    # the runs with a row left in the file, and this one, whose environment the file's other tables carry
    runs = [now] + [r["measured_at"] for table in payload.values() if isinstance(table, list)
                    for r in table if isinstance(r, dict) and "measured_at" in r]
    kept_ceilings = {key: c for key, c in kept_ceilings.items() if c["measured_at"] in runs}
    if kept_ceilings:
        payload["ceilings"] = kept_ceilings
    return write_result(name, payload)


def run_key(env: dict) -> str:
    """The key of a run's entry in a merged file's ``ceilings``: its ``run_id``, or for a run from before run ids
    its date and commit (its entry's ``measured_at`` then tells it apart)."""
    return env.get("run_id") or f"before run ids: {env.get('date', '?')} {env.get('commit', '?')}"


def run_ceilings(ceilings: dict | None, env: dict) -> dict[str, dict]:
    """A result file's ``ceilings`` one entry a run, each with the ``measured_at`` of its run: as merge_rows keeps
    them, or (a file from before) the one run's ceilings, which belong to the file's environment ``env``."""
    if not ceilings:
        return {}
    if all(isinstance(c, dict) and "measured_at" in c for c in ceilings.values()):
        return dict(ceilings)
    return {run_key(env): {"measured_at": env, **ceilings}}


def ceilings_for(payload: dict, row: dict) -> dict | None:
    """The ceilings of the run that measured ``row`` in a merged result file, or None where the file kept none
    for it (a row older than the file's first merge that kept ceilings per run)."""
    at = row.get("measured_at", payload.get("environment", {}))
    runs = run_ceilings(payload.get("ceilings"), payload.get("environment", {}))
    return next((c for c in runs.values() if c["measured_at"] == at), None)


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


def median_difference_ci(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of median(a) - median(b): the resolution of a difference of two medians."""
    import random
    import statistics

    rng = random.Random(seed)
    diffs = sorted(statistics.median(rng.choices(a, k=len(a))) - statistics.median(rng.choices(b, k=len(b)))
                   for _ in range(resamples))
    return diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]
