"""benchmarks/RESULTS.md, the current page: the newest row per (benchmark, model, card, case) in
benchmarks/results/*.json, each with its card, commit and date, and marked stale where the graphserve/ code the
benchmark exercises changed after the commit that measured it. The dated sittings are benchmarks/JOURNAL.md.

Run: python3 -m benchmarks.results_md --current > benchmarks/RESULTS.md   (needs the git history: stale is decided
by ``git log -1 -- PATHS`` against each row's commit)
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import is_ratio_column, ratio_text

REPO = Path(__file__).resolve().parents[1]

# The graphserve/ code each benchmark exercises, coarse on purpose: a row is current only if none of it changed after
# the commit that measured it.
KERNELS = ("graphserve/kernels", "graphserve/layers")
# env.py holds the switches' defaults (PDL, L2 prefetch), which change what a step runs
STEP = (*KERNELS, "graphserve/models", "graphserve/engine", "graphserve/distributed", "graphserve/config.py",
        "graphserve/env.py")
SERVE = (*STEP, "graphserve/server", "graphserve/structured", "graphserve/llm.py", "graphserve/outputs.py",
         "graphserve/bench")
TUNED = (*KERNELS, "graphserve/tuning")
# benchmark -> (the code it exercises, the result-file names it writes besides its own module name)
BENCHMARKS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "accuracy": (STEP, ("accuracy_trained",)),
    "attention_block": (KERNELS, ()),
    "client_capacity": (("graphserve/bench",), ()),
    "cliff": (STEP, ()),
    "decode": (STEP, ()),
    "decode_latency": (KERNELS, ()),
    "decode_prologue": (STEP, ("decode_overlap",)),
    "decode_splits": (KERNELS, ("decode_tiles", "decode_order")),
    "decode_window": (KERNELS, ()),
    "deepseek": (STEP, ("deepseek_decode", "deepseek_offline")),
    "dsa_kernels": (KERNELS, ()),
    "dsa_model": (STEP, ("dsa_decode",)),
    "fp4": (TUNED, ("fp4_kernels",)),
    "fp4_model": (STEP, ("fp4_decode",)),
    "fp4_sass": (KERNELS, ()),
    "fp4_variants": (KERNELS, ()),
    "fp8": (STEP, ("fp8_decode",)),
    "fp8_accuracy": (STEP, ()),
    "fp8_gated_mlp": (TUNED, ()),
    "fp8_kv_attention": (KERNELS, ()),
    "fp8_route": (TUNED, ()),
    "gemv": (TUNED, ()),
    "host_path": (STEP, ()),
    "house_ab": (SERVE, ("house_ab_http",)),
    "http_overhead": (SERVE, ("http_idle_ttft", "http_text")),
    "idle_wake": (SERVE, ()),
    "kernels": (KERNELS, ()),
    "kv_events": ((*STEP, "graphserve/server/cache_events.py"), ()),
    "l2_prefetch": (STEP, ()),
    "launches": (KERNELS, ()),
    "mla": (TUNED, ("mla_sweep",)),
    "moe": (STEP, ("moe_decode",)),
    "moe_fp8": (STEP, ()),
    "moe_kernels": (KERNELS, ("moe_gemv_sweep",)),
    "moe_swiglu": (KERNELS, ()),
    "ncu_kernels": (KERNELS, ()),
    "offline": (SERVE, ()),
    "overhead": (STEP, ()),
    "pdl": (STEP, ()),
    "pdl_join": (STEP, ()),
    "prefill": (STEP, ()),
    "profile": ((*STEP, "graphserve/analysis"), ()),
    "roofline": (("graphserve/tuning/roofline.py",), ()),
    "serve_host": (SERVE, ()),
    "serve_reference": (SERVE, ()),
    "serve_waves": (SERVE, ()),
    "step_breakdown": (STEP, ()),
    "step_host": (STEP, ()),
    "step_skeleton": (STEP, ()),
    "structured": (SERVE, ()),
    "tp": (STEP, ()),
    "xcheck": (("graphserve/bench",), ("xcheck_bench_serving",)),
    # the files of modules that have left the tree (JOURNAL.md names the commit that removed each)
    "retired": (STEP, ("expert_prefetch", "fp8_early", "fp8_norm_read", "gemv_prefetch", "moe_scan")),
}
# what reruns a benchmark that is no module of benchmarks/
COMMANDS = {"profile": "graphserve profile", "retired": "no command: the module is gone, JOURNAL.md says where"}
# The fields that say which case a row measured (the rest are what it measured).
CASE_FIELDS = ("quantization", "kv_cache_dtype", "bs", "ctx", "graph", "routing", "mode", "concurrency", "client",
               "api_server_count", "case", "variant", "kernel", "shape", "family", "method", "fusion", "cache",
               "tables", "order", "tile", "splits", "proj", "fmt", "m", "n", "k", "M", "N", "K", "widen", "path",
               "config", "dtype", "comparison", "gap_ms", "wait", "round", "overlap", "batch", "temperature", "scales",
               "tokens", "pairs", "gate_up", "down", "down_input", "run", "backend", "heads", "prologue", "knobs",
               "pieces", "tp", "ep", "topk", "chunks_per_req", "label", "workload")
# The cases README.md quotes under "Performance": (benchmark, model, case), every card's row of each, as the page has it
HEADLINES = (
    ("decode", "dummy:llama3-8b", "bs=1 ctx=512 graph=True"),
    ("decode", "dummy:llama3-8b", "bs=64 ctx=2048 graph=True"),
    ("fp8", "dummy:llama3-8b --quantization fp8", "bs=1 ctx=512"),
    ("fp8", "dummy:llama3-8b --quantization fp8", "bs=64 ctx=2048"),
    ("moe", "dummy:qwen3-30b-a3b", "bs=64 ctx=1024 routing=uniform"),
    ("fp8", "dummy:qwen3-30b-a3b --quantization fp8", "bs=64 ctx=2048"),
    ("deepseek", "dummy:deepseek-v2-lite", "bs=64 ctx=1024 routing=router"),
)
TABLE_HEAD = "| card | model | case | measured | commit | date | file | status |\n|---|---|---|---|---|---|---|---|"
# A result file with more newest rows than this is summarised in one line a run (tile sweeps, per-kernel tables).
MAX_ROWS = 40
SHOWN_MEASURES = 5


@dataclass
class Row:
    benchmark: str
    file: str
    model: str
    card: str
    case: str
    commit: str
    date: str
    started: str
    measures: str
    status: str = ""


def benchmark_of(stem: str) -> str:
    """The benchmark that wrote results/STEM.json: the longest module name or result name that STEM is, or starts
    with followed by ``_`` (``decode_splits_fp8`` is decode_splits', ``decode_bs1`` decode's); "other" for none."""
    names = [(name, bench) for bench, (_, extra) in BENCHMARKS.items() for name in (bench, *extra)]
    # a module not listed above is still a benchmark (its code taken as the whole step's, STEP)
    names += [(m.stem, m.stem) for m in Path(__file__).parent.glob("*.py") if m.stem not in BENCHMARKS]
    hits = [(name, bench) for name, bench in names if stem == name or stem.startswith(name + "_")]
    return max(hits, key=lambda h: len(h[0]))[1] if hits else "other"


def table_of(data) -> tuple[list[dict], dict]:
    """(rows, environment) of a result file: its ``rows``, else its first non-empty table of objects."""
    if isinstance(data, list):
        data = {"rows": data}
    tables = [data.get("rows")] + [v for k, v in data.items() if k != "rows"]
    rows = next((t for t in tables if isinstance(t, list) and t and all(isinstance(r, dict) for r in t)), [])
    return rows, data.get("environment", {})


def _text(v) -> str:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v)


def cell_text(v, col: str = "") -> str:
    """A measured value as a cell of the current page and of results_md's tables."""
    if isinstance(v, float) and is_ratio_column(col):
        return ratio_text(v, thousands=True)
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.1f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return "—" if v is None else str(v)


def rows_of(path: Path) -> list[Row]:
    data = json.loads(path.read_text())
    rows, env = table_of(data)
    # a file that names its model and case once, at its top (step_breakdown's model, quantization, bs, ctx), lends
    # them to each row: without them the rows of two such files are one case, and the newer hides the other
    top = {k: v for k, v in data.items() if k in ("model", *CASE_FIELDS) and isinstance(v, (str, int, float))
           } if isinstance(data, dict) else {}  # fmt: skip
    out = []
    for r in rows:
        r = {**top, **r}
        at = r.get("measured_at") or env
        case = " ".join(f"{f}={_text(r[f])}" for f in CASE_FIELDS if f in r)
        measured = [c for c, v in r.items() if c not in CASE_FIELDS and isinstance(v, float)]
        shown = measured[:SHOWN_MEASURES] + [c for c in measured[SHOWN_MEASURES:] if c == "ratio"]
        out.append(Row(benchmark_of(path.stem), path.name, str(r.get("model", "—")),
                       str(r.get("card") or at.get("device") or "?"), case, str(at.get("commit", "?")),
                       str(at.get("date", "?")), str(at.get("started", "")),
                       " · ".join(f"{c} {cell_text(r[c], c)}" for c in shown)))
    return out


class History:
    """What git says about commits, asked once each."""

    def __init__(self, root: Path):
        self.root = root
        log = self._git("rev-list", "--topo-order", "--reverse", "HEAD") or ""
        self.rank = {sha[:7]: i for i, sha in enumerate(log.split())}
        self._last: dict[tuple[str, ...], str] = {}
        self._ancestor: dict[tuple[str, str], bool] = {}

    def _git(self, *args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(self.root), *args], capture_output=True, text=True,
                                  check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None

    def order(self, commit: str) -> int:
        return self.rank.get(commit[:7], -1)

    def last_change(self, paths: tuple[str, ...]) -> str:
        if paths not in self._last:
            self._last[paths] = (self._git("log", "-1", "--format=%h", "--", *paths) or "").strip()
        return self._last[paths]

    def contains(self, commit: str, ancestor: str) -> bool:
        key = (commit, ancestor)
        if key not in self._ancestor:
            self._ancestor[key] = self._git("merge-base", "--is-ancestor", ancestor, commit) is not None
        return self._ancestor[key]


def status(row: Row, history: History) -> str:
    """"current", or why the row is not quoted as current: measured on a dirty tree, at a commit this history does not
    hold, or before the last change to the code its benchmark exercises."""
    if "+" in row.commit or row.commit.endswith("-dirty"):
        return f"dirty ({row.commit}): not a commit's code"
    if history.order(row.commit) < 0:
        return f"unknown commit {row.commit}"
    changed = history.last_change(BENCHMARKS.get(row.benchmark, (STEP, ()))[0])
    if changed and not history.contains(row.commit, changed):
        return f"stale: code changed at {changed}"
    return "current"


def newest(rows: list[Row], history: History) -> list[Row]:
    """The newest row of each (benchmark, model, card, case): by date, then commit order, then run start."""
    best: dict[tuple[str, str, str, str], Row] = {}
    for r in rows:
        key = (r.benchmark, r.model, r.card, r.case)
        rank = (r.date, history.order(r.commit), r.started)
        if key not in best or rank >= (best[key].date, history.order(best[key].commit), best[key].started):
            best[key] = r
    for r in best.values():
        r.status = status(r, history)
    return list(best.values())


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or "—"


def section(bench: str, rows: list[Row], history: History) -> list[str]:
    paths = BENCHMARKS.get(bench, (STEP, ()))[0]
    current = sum(r.status == "current" for r in rows)
    command = COMMANDS.get(bench, f"python3 -m benchmarks.{bench}")
    lines = [f"## {bench}", "",
             f"`{command}` · {current} of {len(rows)} rows current · its code "
             f"({', '.join(paths)}) last changed at {history.last_change(paths) or '?'}", ""]
    rows = sorted(rows, key=lambda r: (r.status != "current", r.file, r.model, r.card, r.case))
    per_file: dict[str, int] = {}
    for r in rows:
        per_file[r.file] = per_file.get(r.file, 0) + 1
    shown = [r for r in rows if per_file[r.file] <= MAX_ROWS]
    if shown:
        lines += TABLE_HEAD.split("\n")
        lines += [f"| {r.card} | {_cell(r.model)} | {_cell(r.case)} | {_cell(r.measures)} | {r.commit} | {r.date} | "
                  f"`results/{r.file}` | {r.status} |" for r in shown]
        lines += [""]
    if len(shown) < len(rows):
        groups: dict[tuple[str, str, str, str, str], int] = {}
        for r in rows:
            if per_file[r.file] > MAX_ROWS:
                key = (r.file, r.card, r.commit, r.date, r.status)
                groups[key] = groups.get(key, 0) + 1
        lines += ["| file | card | cases | commit | date | status |", "|---|---|---|---|---|---|"]
        lines += [f"| `results/{f}` | {c} | {n} | {commit} | {d} | {s} |" for (f, c, commit, d, s), n in groups.items()]
        lines += [""]
    return lines


def current_page(results: Path | None = None, root: Path | None = None) -> str:
    root = root or REPO
    results = results or root / "benchmarks" / "results"
    history = History(root)
    rows = newest([r for p in sorted(results.glob("*.json")) for r in rows_of(p)], history)
    by_bench: dict[str, list[Row]] = {}
    for r in rows:
        by_bench.setdefault(r.benchmark, []).append(r)
    total = sum(r.status == "current" for r in rows)
    head = (history._git("rev-parse", "--short", "HEAD") or "?").strip()
    lines = ["# Benchmark results: where things stand", "",
             f"Generated by `python3 -m benchmarks.results_md --current` at commit {head} from `benchmarks/results/*.json`: "
             "the newest row of each (benchmark, model, card, case), with the card, commit and date that measured it. "
             "A row is **current** when none of the graphserve/ code its benchmark exercises changed after that commit; "
             "otherwise it says **stale** and the commit that changed the code, and is not to be quoted as today's "
             "number. A row measured on a tree with uncommitted changes says **dirty**. "
             f"{total} of {len(rows)} rows are current. The dated sittings, with the reasoning behind each "
             "number, are in [JOURNAL.md](JOURNAL.md); which module answers which question is in "
             "[README.md](README.md).", ""]
    for bench in sorted(by_bench):
        lines += section(bench, by_bench[bench], history)
    return "\n".join(lines).rstrip() + "\n"


def headlines(page: str) -> str:
    """README.md's performance table: the HEADLINES rows exactly as the current page ``page`` shows them."""
    bench, found = "", {}
    for line in page.splitlines():
        if line.startswith("## "):
            bench = line[3:].strip()
        elif line.startswith("| ") and not line.startswith(("| card |", "| file |")):
            cells = line.split(" | ")
            found.setdefault((bench, cells[1], cells[2]), []).append(line)
    missing = [h for h in HEADLINES if (h[0], _cell(h[1]), _cell(h[2])) not in found]
    if missing:
        raise KeyError(f"the current page has no row for {missing}")
    return "\n".join([TABLE_HEAD] + [row for h in HEADLINES for row in found[(h[0], _cell(h[1]), _cell(h[2]))]])
