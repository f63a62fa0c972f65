"""`graphserve compare A.json B.json`: did B change anything, beyond the noise?

For each metric, B − A and (B/A − 1) with a 95% bootstrap interval. The bootstrap is
hierarchical: draw runs with replacement from each side's repeats, then requests with
replacement inside each drawn run, compute the metric per run and average over runs. With one
file per side it is the plain request bootstrap. Output throughput is resampled as the drawn
requests' output tokens over the run's wall time: the run length is what the benchmark fixed,
the requests are what varies. The verdict is "faster" or "slower" only when the interval of
B − A excludes zero; lower latency and higher throughput are faster.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphserve.analysis.stats import interval
from graphserve.errors import BadRequestError

LATENCIES = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "p50", "p90", "p99")
METRICS = ("output_throughput",) + tuple(f"{m}_{s}" for m in LATENCIES for s in STATS)
NO_DIFF = "no difference within noise"


@dataclass
class _Column:
    """One latency over a run's requests, sorted once so that any resample is a re-weighting."""

    values: np.ndarray  # all values, ascending
    owner: np.ndarray  # request index of each value


class RunData:
    """Per-request columns of one result file, ready to resample.

    A resample of requests is a vector of multiplicities (how often each request was drawn);
    every metric is then a weighted mean or weighted percentile over the pre-sorted values.
    """

    def __init__(self, duration_s: float, output_tokens: np.ndarray, cols: dict[str, _Column]):
        self.duration_s = duration_s
        self.output_tokens = output_tokens
        self.cols = cols

    @property
    def n(self) -> int:
        return len(self.output_tokens)

    @classmethod
    def from_result(cls, result: dict[str, Any], name: str = "result") -> RunData:
        if "requests" not in result and ("points" in result or "configurations" in result):
            raise BadRequestError(f"{name} is a sweep's summary ({_sweep_kind(result)}): compare takes result files "
                                  f"with per-request records, from graphserve bench --output-file or a sweep's "
                                  f"levels/ folder ({_level_files(result, name)})", param="requests")
        reqs = [r for r in result.get("requests", []) if r.get("ok", True)]
        if not reqs:
            raise BadRequestError(f"{name} has no successful requests to compare", param="requests")
        starts = [r["start"] for r in reqs if r.get("start") is not None]
        ends = [r["end"] for r in reqs if r.get("end") is not None]
        duration = result.get("summary", {}).get("duration_s") or (max(ends) - min(starts) if starts and ends else 0)
        if not duration or duration <= 0:
            raise BadRequestError(f"{name}: duration_s={duration!r} is invalid: must be > 0", param="duration_s")
        cols = {}
        for m in LATENCIES:
            vals, owners = [], []
            for i, r in enumerate(reqs):
                v = r.get("itl_ms") if m == "itl" else r.get(f"{m}_ms")
                if v is None:
                    continue
                v = list(v) if m == "itl" else [v]
                vals += v
                owners += [i] * len(v)
            order = np.argsort(np.asarray(vals, dtype=float), kind="stable")
            cols[m] = _Column(np.asarray(vals, dtype=float)[order], np.asarray(owners, dtype=int)[order])
        return cls(float(duration), np.asarray([r.get("output_tokens") or 0 for r in reqs], dtype=float), cols)

    def metric(self, name: str, mult: np.ndarray) -> float:
        """The metric over a resample given as per-request multiplicities ``mult``."""
        if name == "output_throughput":
            return float(mult @ self.output_tokens / self.duration_s)
        lat, stat = name.rsplit("_", 1)
        col = self.cols[lat]
        w = mult[col.owner]
        total = w.sum()
        if not col.values.size or total <= 0:
            return float("nan")
        if stat == "mean":
            return float(w @ col.values / total)
        # Weighted inverted-CDF percentile: the smallest value whose cumulative weight reaches q.
        cw = np.cumsum(w)
        k = int(np.searchsorted(cw, float(stat[1:]) / 100.0 * total, side="left"))
        return float(col.values[min(k, col.values.size - 1)])


@dataclass
class MetricComparison:
    metric: str
    a: float
    b: float
    diff: float
    diff_ci: tuple[float, float]
    rel: float
    rel_ci: tuple[float, float]
    verdict: str


def _higher_is_better(metric: str) -> bool:
    return metric == "output_throughput"


def _side_draws(runs: Sequence[RunData], metrics: Sequence[str], rng: np.random.Generator,
                n_boot: int) -> dict[str, np.ndarray]:
    out = {m: np.empty(n_boot) for m in metrics}
    for b in range(n_boot):
        picks = rng.integers(0, len(runs), len(runs)) if len(runs) > 1 else [0]
        per_run = {m: [] for m in metrics}
        for k in picks:
            run = runs[k]
            mult = np.bincount(rng.integers(0, run.n, run.n), minlength=run.n).astype(float)
            for m in metrics:
                per_run[m].append(run.metric(m, mult))
        for m in metrics:
            vals = np.asarray(per_run[m])
            out[m][b] = vals[np.isfinite(vals)].mean() if np.isfinite(vals).any() else np.nan
    return out


def _point(runs: Sequence[RunData], metric: str) -> float:
    vals = np.asarray([r.metric(metric, np.ones(r.n)) for r in runs])
    return float(vals[np.isfinite(vals)].mean()) if np.isfinite(vals).any() else float("nan")


def compare_runs(a_runs: Sequence[RunData], b_runs: Sequence[RunData], metrics: Sequence[str] | None = None,
                 n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> list[MetricComparison]:
    metrics = list(metrics or METRICS)
    for m in metrics:
        if m not in METRICS:
            raise BadRequestError(f"--metric={m!r} is invalid: choose from {', '.join(METRICS)}", param="metric")
    # Metrics absent on either side (TPOT of non-streamed runs) are left out rather than guessed.
    points = {m: (_point(a_runs, m), _point(b_runs, m)) for m in metrics}
    metrics = [m for m in metrics if all(np.isfinite(points[m]))]
    rng = np.random.default_rng(seed)
    draws_a = _side_draws(a_runs, metrics, rng, n_boot)
    draws_b = _side_draws(b_runs, metrics, rng, n_boot)
    out = []
    for m in metrics:
        point_a, point_b = points[m]
        da, db = draws_a[m], draws_b[m]
        diff_ci = interval(db - da, level)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel_ci = interval(db / da - 1.0, level)
        if diff_ci[0] > 0 or diff_ci[1] < 0:
            up = diff_ci[0] > 0
            verdict = "faster" if up == _higher_is_better(m) else "slower"
        else:
            verdict = NO_DIFF
        rel = point_b / point_a - 1.0 if point_a else float("nan")
        out.append(MetricComparison(m, point_a, point_b, point_b - point_a, diff_ci, rel, rel_ci, verdict))
    return out


def _sweep_kind(result: dict[str, Any]) -> str:
    return "a grid of configurations" if "configurations" in result else "one line per concurrency level"


def _level_files(result: dict[str, Any], name: str) -> str:
    """The per-level result files a sweep's results.json points at, as paths beside it (three at most)."""
    configs = result.get("configurations") or [result]
    files = [p["result_file"] for c in configs for p in (c.get("points") or []) if p.get("result_file")]
    if not files:
        return "e.g. levels/c8.json"
    base = Path(name).parent
    shown = ", ".join(str(base / f) for f in files[:3])
    return f"e.g. {shown}" + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def format_table(rows: Sequence[MetricComparison]) -> str:
    head = f"{'metric':<18} {'A':>10} {'B':>10} {'B-A':>10} {'95% CI':>22} {'rel':>8} {'rel 95% CI':>18}  verdict"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.metric:<18} {r.a:>10.2f} {r.b:>10.2f} {r.diff:>+10.2f} "
                     f"{f'[{r.diff_ci[0]:+.2f}, {r.diff_ci[1]:+.2f}]':>22} {r.rel * 100:>+7.1f}% "
                     f"{f'[{r.rel_ci[0] * 100:+.1f}%, {r.rel_ci[1] * 100:+.1f}%]':>18}  {r.verdict}")
    return "\n".join(lines)


def _load(paths: Sequence[str]) -> list[RunData]:
    return [RunData.from_result(json.loads(Path(p).read_text()), p) for p in paths]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="baseline result JSON (graphserve bench --output-file)")
    parser.add_argument("b", help="candidate result JSON")
    parser.add_argument("--repeats-a", "--repeats", nargs="+", default=[], help="more runs of A (repeats)")
    parser.add_argument("--repeats-b", nargs="+", default=[], help="more runs of B (repeats)")
    parser.add_argument("--metric", action="append", default=None, help=f"one of {', '.join(METRICS)}; repeatable")
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap draws")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    rows = compare_runs(_load([args.a, *args.repeats_a]), _load([args.b, *args.repeats_b]), args.metric,
                        n_boot=args.bootstrap, seed=args.seed)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(format_table(rows))
    return 0
