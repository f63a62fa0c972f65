"""Timing and run records shared by `graphserve tune` and the benchmarks (benchmarks/common.py and kernels.py
re-export them): CUDA-event timing, calls captured in one CUDA graph, the run's environment, and the tables
printed as each measurement lands."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import torch

from graphserve import env

REPO = Path(__file__).resolve().parents[2]
# Files the runs themselves write (result files, RESULTS.md, the per-card tables `graphserve tune` and the rule
# writers leave under graphserve/kernels): a tree holding new ones still runs the committed code.
WRITTEN_BY_RUNS = (":(exclude)benchmarks/results", ":(exclude,glob)**/*.md", ":(exclude,glob)graphserve/kernels/**/*.json")


class DirtyTreeError(RuntimeError):
    """Results would be stamped with a commit whose code is not what ran."""


def _git(root: Path, *args: str, env_extra: dict[str, str] | None = None) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                              timeout=60, env={**os.environ, **env_extra} if env_extra else None).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def tree_changes(root: Path | None = None) -> list[str] | None:
    """``git status --porcelain`` lines of uncommitted changes to the code under graphserve/ and benchmarks/; None
    where ``root`` is not the top of a git checkout (a tree copied without .git, or a package installed inside
    some other repository)."""
    root = root or REPO
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != root.resolve():
        return None
    status = _git(root, "status", "--porcelain", "--", "graphserve", "benchmarks", *WRITTEN_BY_RUNS)
    return None if status is None else status.splitlines()


def code_tree(root: Path | None = None) -> str | None:
    """The git tree id of graphserve/ and benchmarks/ as they lie on disk (the files runs write left out), whatever
    the checkout's HEAD: equal ids, equal code. Built in a throw-away index, so the checkout's own is untouched; None
    without git."""
    root = root or REPO
    with tempfile.TemporaryDirectory() as tmp:
        index = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        if _git(root, "add", "-A", "--", "graphserve", "benchmarks", *WRITTEN_BY_RUNS, env_extra=index) is None:
            return None
        tree = _git(root, "write-tree", env_extra=index)
    return tree.strip() if tree else None


def git_commit(root: Path | None = None) -> str:
    """The commit measured: $GRAPHSERVE_COMMIT (set it where the tree travels without .git), else git's HEAD.

    A checkout with uncommitted changes under graphserve/ or benchmarks/ is refused (DirtyTreeError): its numbers
    would be credited to a commit that does not hold the code that made them. GRAPHSERVE_ALLOW_DIRTY=1 stamps it
    ``<commit>-dirty`` instead.

    ``GRAPHSERVE_COMMIT=COMMIT:TREE`` (what ``python3 -m graphserve.tuning.timing`` prints on a clean checkout)
    names the commit of a tree copied beside some other ``.git`` (a machine given the working tree and an older
    history): its files differ from that HEAD, but where their ``code_tree`` is TREE they are COMMIT's code and the
    stamp is COMMIT, clean."""
    root = root or REPO
    changes = tree_changes(root)
    named, _, tree = (env.get("GRAPHSERVE_COMMIT") or "").partition(":")
    if changes and tree and code_tree(root) == tree:
        return named
    if changes and not env.flag("GRAPHSERVE_ALLOW_DIRTY"):
        shown = "; ".join(line.strip() for line in changes[:5]) + ("; ..." if len(changes) > 5 else "")
        raise DirtyTreeError(f"refusing to stamp results with a commit: {len(changes)} uncommitted change(s) under "
                             f"graphserve/ or benchmarks/ ({shown}); commit them, or set GRAPHSERVE_ALLOW_DIRTY=1 "
                             f"to stamp the commit '-dirty'")
    commit = named or (_git(root, "rev-parse", "--short", "HEAD") or "unknown").strip()
    return f"{commit}-dirty" if changes and not commit.endswith("-dirty") else commit


_RUN: dict[str, str] = {}


def start_run() -> dict[str, str]:
    """A new run: a fresh id (uuid4 hex) and its start time (UTC). A process is one run, started at its first
    ``environment()``; tests call this to stand for a second run."""
    _RUN.clear()
    _RUN.update(run_id=uuid.uuid4().hex,
                started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    return dict(_RUN)


def environment() -> dict:
    """This run: date, commit, versions, device, and its ``run_id`` and ``started`` time, the same for every file and
    row the process writes, so rows merged into one file say which run (and so which ceilings) measured them."""
    if not _RUN:
        start_run()
    env = {
        **_RUN,
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


def cuda_time_ms(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median wall time of ``fn()`` in ms, measured with CUDA events (GPU) or perf_counter (CPU)."""
    import statistics

    return statistics.median(cuda_times_ms(fn, warmup, iters))


def cuda_times_ms(fn, warmup: int = 3, iters: int = 20) -> list[float]:
    """Each of ``iters`` timed calls of ``fn()`` in ms (CUDA events on a GPU, perf_counter on CPU)."""

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


class CapturedCalls:
    """``calls`` back-to-back calls of ``fn`` captured in one CUDA graph; calling it replays the graph. It holds
    ``fn``: the graph reads and writes the buffers ``fn`` closes over, which must outlive every replay (freed, the
    caching allocator may hand them to another tensor or release them)."""

    def __init__(self, fn, calls: int = 1):
        self.fn, self.calls = fn, calls
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # the inputs the caller just made on its own stream
        with torch.cuda.stream(stream):
            fn()  # compile and settle allocations outside the capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            for _ in range(calls):
                fn()

    def __call__(self) -> None:
        self.graph.replay()


def graph_time_ms(fn, calls: int = 20, replays: int = 5) -> float:
    """GPU time of one ``fn()`` from a CUDA graph holding ``calls`` back-to-back calls."""
    return cuda_time_ms(CapturedCalls(fn, calls), warmup=2, iters=replays) / calls


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = [max([len(c)] + [len(_fmt(r.get(c), c)) for r in rows]) for c in cols]  # no rows: the header alone
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c), c).rjust(w) for c, w in zip(cols, widths)))


# a column named a quotient ("stream/floor") or holding one of these words (ratio, bf16_ratio, vs_bf16, dram_pct) is a
# ratio, read against targets; words, so that duration_us is not one
RATIO_WORDS = {"ratio", "vs", "pct", "share"}


def is_ratio_column(col: str) -> bool:
    return "/" in col or not RATIO_WORDS.isdisjoint(re.split(r"[^a-z0-9]+", col.lower()))


def ratio_text(v: float, thousands: bool = False) -> str:
    """A ratio with 4 decimals, and more where 4 would end in a 0 the value is not: a rendering never lands on a
    3-decimal number (a target such as 1.3 or 0.45) that the value misses, so 1.3004 reads 1.3004 and 1.30004
    reads 1.30004, never 1.300 or 1.3000."""
    sep = "," if thousands else ""
    for digits in range(4, 13):
        text = f"{v:{sep}.{digits}f}"
        if not text.endswith("0") or float(text.replace(",", "")) == v:
            return text
    return f"{v:{sep}}"  # Python's shortest text that reads back as v: 1.3000000000000003


def _fmt(v, col: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and is_ratio_column(col):
        return ratio_text(v)
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def main() -> None:
    """Print the stamp results written now would carry, or refuse (exit 1) where the checkout holds uncommitted code:
    ``GRAPHSERVE_COMMIT=$(python3 -m graphserve.tuning.timing)`` names the commit for a tree copied without .git or
    beside an older one: ``COMMIT:TREE``, the tree id of its code (``code_tree``) that proves a copy holds it."""
    try:
        commit = git_commit()
        tree = code_tree() if not commit.endswith("-dirty") else None
        print(f"{commit}:{tree}" if tree else commit)
    except DirtyTreeError as e:
        raise SystemExit(str(e)) from None


if __name__ == "__main__":
    main()
