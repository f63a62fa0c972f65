"""The GPU test files, what each is expected to take, and their packing into shards that each fit one command.

A GPU machine gives a command at most 600 s and the whole of `tests/gpu` takes ~25 minutes on an H100, so the suite
runs in shards (`benchmarks/gpu_tests.py`). Each file's expected time comes from `tests/gpu/durations.json`: seconds
per file as pytest measured them (its junit suite time, after each run), or an estimate from the file's count of tests
where no run has measured it yet (``"source": "estimate"``). A file is never split: its module-scoped models and
engines are built once. Files that skip the whole module below two GPUs form their own group, run only where several
are present.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS_DIR = REPO / "tests" / "gpu"
DURATIONS = TESTS_DIR / "durations.json"

# A command gets 600 s; the runner stops starting files at its deadline (570 s) and the stamp and record take a few
# seconds, so shards are packed to 480 s of estimates: a shard whose files run 15% over their estimates still ends.
BUDGET_S = 480.0
# A file with no measurement: each test ~1 s plus a base. Fitted loosely to the seeded H100 runs, where kernel files
# take 0.6-1.3 s a test (test_gemv, test_fp8) and engine files far more a test but have few; the unmeasured files
# hold ~500 of the suite's ~890 tests in the ~5 minutes the measured ones leave of its ~25.
ESTIMATE_BASE_S = 10.0
ESTIMATE_PER_TEST_S = 1.0
# Each file runs in its own Python (interpreter, torch, CUDA context, graphserve imports) before pytest's clock starts.
STARTUP_S = 10.0

_MODULE_GPUS = re.compile(r"^pytestmark\s*=\s*pytest\.mark\.skipif\(\s*torch\.cuda\.device_count\(\)\s*<\s*(\d+)", re.M)
_TEST_DEF = re.compile(r"^\s*(?:async\s+)?def test_", re.M)


def gpu_test_files(tests_dir: Path = TESTS_DIR) -> list[str]:
    return sorted(p.name for p in tests_dir.glob("test_*.py"))


def gpus_needed(path: Path) -> int:
    """The GPUs a file's module-level skip asks for (``pytestmark = pytest.mark.skipif(torch.cuda.device_count() <
    N, ...)``): 1 for every other file."""
    m = _MODULE_GPUS.search(path.read_text())
    return int(m.group(1)) if m else 1


def group_of(path: Path) -> str:
    return "multi" if gpus_needed(path) >= 2 else "single"


def load_durations(path: Path = DURATIONS) -> dict:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("startup_s", {"seconds": STARTUP_S, "source": "estimate"})
    data.setdefault("files", {})
    return data


def save_durations(data: dict, path: Path = DURATIONS) -> None:
    data["files"] = dict(sorted(data["files"].items()))
    path.write_text(json.dumps(data, indent=1) + "\n")


def estimate_entry(path: Path) -> dict:
    """A file nobody has timed: its ``def test_`` count (parametrized cases each count once, so a floor) at
    ESTIMATE_PER_TEST_S a test."""
    tests = len(_TEST_DEF.findall(path.read_text()))
    return {"seconds": round(ESTIMATE_BASE_S + ESTIMATE_PER_TEST_S * tests), "tests": tests, "source": "estimate",
            "counted": "grep 'def test_'"}


def estimates(files: list[str], durations: dict, tests_dir: Path = TESTS_DIR) -> dict[str, float]:
    """Each file's expected seconds in its own process: its pytest time (measured or estimated) plus start-up."""
    startup = float(durations["startup_s"]["seconds"])
    out = {}
    for name in files:
        entry = durations["files"].get(name) or estimate_entry(tests_dir / name)
        out[name] = float(entry["seconds"]) + startup
    return out


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based, as on the command line
    files: tuple[str, ...]
    seconds: float
    alone: bool = False  # one file whose estimate alone is over the budget


def _lpt(items: list[tuple[str, float]], bins: int) -> list[list[tuple[str, float]]]:
    """Largest first, each into the least loaded bin (the lowest index on a tie): within 4/3 of the best packing."""
    packed: list[list[tuple[str, float]]] = [[] for _ in range(bins)]
    loads = [0.0] * bins
    for name, sec in items:
        i = loads.index(min(loads))
        packed[i].append((name, sec))
        loads[i] += sec
    return packed


def pack(est: dict[str, float], shards: int | None = None, budget_s: float = BUDGET_S) -> list[Shard]:
    """Files into shards of similar estimated time, the same answer for the same estimates. A file over the budget
    gets a shard of its own; the rest go largest first into ``shards`` shards in all, or, without ``shards``, into
    as few as keep each within ``budget_s``."""
    order = sorted(est.items(), key=lambda kv: (-kv[1], kv[0]))
    alone = [(n, s) for n, s in order if s > budget_s]
    rest = [(n, s) for n, s in order if s <= budget_s]
    if shards is None:
        bins = math.ceil(sum(s for _, s in rest) / budget_s) if rest else 0
        while rest and max(sum(s for _, s in b) for b in _lpt(rest, bins)) > budget_s:
            bins += 1
    else:
        bins = shards - len(alone)
        if bins < (1 if rest else 0):
            raise ValueError(f"{shards} shard(s) cannot hold these files: {len(alone)} file(s) over the "
                             f"{budget_s:.0f} s budget each need a shard of their own and {len(rest)} other(s) need "
                             f"at least one more; ask for --shard I/{len(alone) + (1 if rest else 0)} or more")
    groups = [[(n, s)] for n, s in alone] + _lpt(rest, bins)
    return [Shard(i + 1, tuple(n for n, _ in g), sum(s for _, s in g), alone=i < len(alone))
            for i, g in enumerate(groups)]


def packing_notes(shards: list[Shard], budget_s: float) -> list[str]:
    """What the packing could not keep within the budget, one line each."""
    notes = []
    for sh in shards:
        if sh.alone:
            notes.append(f"{sh.files[0]}: estimated {sh.seconds:.0f} s, over the {budget_s:.0f} s budget: alone in "
                         f"shard {sh.index}; it may not finish within one 600 s command")
        elif sh.seconds > budget_s:
            notes.append(f"shard {sh.index}: estimated {sh.seconds:.0f} s, over the {budget_s:.0f} s budget: use more "
                         f"shards, or --budget-s {budget_s:.0f} to choose their number")
    return notes


def update_durations(data: dict, results: list[dict], environment: dict) -> list[str]:
    """Fold one run's per-file results into ``data``: a file that ran to its end takes pytest's junit suite time; one
    cut off by its timeout keeps the larger of its entry and the time it had; one whose every test skipped (a
    multi-GPU file on one GPU) says nothing about its time. Start-up becomes the median of wall minus pytest time.
    Returns the names updated."""
    updated, startups = [], []
    for r in results:
        old = data["files"].get(r["file"], {})
        if r["status"] in ("passed", "failed") and r.get("pytest_seconds") is not None:
            entry = {"seconds": round(r["pytest_seconds"], 1), "tests": r["tests"], "source": "measured"}
            startups.append(r["seconds"] - r["pytest_seconds"])
        elif r["status"] == "timeout":
            entry = {"seconds": round(max(float(old.get("seconds", 0)), r["seconds"]), 1),
                     "tests": old.get("tests", r["tests"]), "source": "measured: timed out, a floor"}
        else:
            continue
        entry.update(card=environment.get("device"), commit=environment.get("commit"), date=environment.get("date"))
        data["files"][r["file"]] = entry
        updated.append(r["file"])
    if startups:
        data["startup_s"] = {"seconds": round(max(0.0, statistics.median(startups)), 1), "source": "measured",
                             "card": environment.get("device"), "date": environment.get("date")}
    return updated
