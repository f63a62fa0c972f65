"""What a configuration grid says, in words: per concurrency level, each configuration against the
first with a bootstrap interval (analysis/compare.py on the level's per-request results), and
whether each scaling fit can be trusted enough to quote its ceiling.

A verdict reads "cuda_graph_max_bs=64 is 1.39× [1.33, 1.45] the output tok/s of 32 at C=64": the
ratio of whole-run output throughput (B/A) with its 95% interval; where that interval holds 1.0,
"no difference at C=1" (also where the ratio is within 1% of 1, see MIN_EFFECT).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from graphserve.analysis.compare import RunData, compare_runs
from graphserve.analysis.scaling import ceiling_doubt
from graphserve.errors import GraphserveError

VERDICT_METRICS = ("output_throughput", "tpot_p50", "ttft_p50")
# Below this R² a straight line explains too little of the step times for its ceiling to mean anything.
MIN_R2 = 0.5
MIN_DISTINCT_N = 3
# Prefill and mixed steps run in between the decode steps the telemetry fit reads; above this share
# of the window they stretch the decode steps around them (and the request TPOTs) unevenly.
MAX_NON_DECODE_SHARE = 0.2
# The bootstrap resamples the requests of one run per level, so it sees request-to-request noise only;
# with equal output lengths the throughput interval even collapses to a point. A ratio within 1% of 1 is
# therefore not called a difference, whatever its interval.
MIN_EFFECT = 0.01


def labels(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """One short name per configuration: the grid values that differ between them ("cfg0" when none)."""
    params = [dict(c.get("params") or {}) for c in configs]
    keys = [k for k in (params[0] if params else {}) if len({p.get(k) for p in params}) > 1]
    out = []
    for i, p in enumerate(params):
        out.append(", ".join(f"{k}={p.get(k)}" for k in keys) or ", ".join(f"{k}={v}" for k, v in p.items())
                   or f"cfg{i}")
    return out


def short_value(label: str) -> str:
    """"cuda_graph_max_bs=32" -> "32": the baseline is named by its value once the key was said."""
    return label.split("=", 1)[1] if label.count("=") == 1 else label


def fit_quality(fit: Mapping[str, Any] | None, distinct_n: int, non_decode_share: float | None = None) -> dict:
    """{"reliable": bool, "reasons": [...]}: why a fit's ceiling should not be quoted, if it should not."""
    if not fit:
        return {"reliable": False, "reasons": ["no fit"]}
    reasons = []
    if fit.get("r2") is not None and fit["r2"] < MIN_R2:
        reasons.append(f"R² = {fit['r2']:.2f} < {MIN_R2}: the line explains little of the step-time variation")
    if distinct_n < MIN_DISTINCT_N:
        reasons.append(f"only {distinct_n} distinct batch size(s) (needs at least {MIN_DISTINCT_N})")
    if non_decode_share is not None and non_decode_share > MAX_NON_DECODE_SHARE:
        reasons.append(f"{non_decode_share:.0%} of the steps were prefill or mixed: they stretch the decode "
                       f"steps around them")
    if fit.get("b_ms") is not None and fit["b_ms"] <= 0:
        reasons.append(f"b = {fit['b_ms']:.3f} ms <= 0: no per-request cost was seen, so no ceiling")
    doubt = ceiling_doubt(fit["b_ms"], fit["b_ci"]) if fit.get("b_ms") is not None and fit.get("b_ci") else None
    if doubt is not None:
        reasons.append(doubt)
    return {"reliable": not reasons, "reasons": reasons}


def _level_run(output_dir: str, point: Mapping[str, Any]) -> RunData | None:
    path = point.get("result_file")
    if not path:
        return None
    full = path if os.path.isabs(path) else os.path.join(output_dir, path)
    try:
        with open(full, encoding="utf-8") as f:
            return RunData.from_result(json.load(f), full)
    except (OSError, GraphserveError):
        return None  # a level with no successful request has nothing to compare


def _ratio(row: Any) -> tuple[float, float, float]:
    return 1.0 + row.rel, 1.0 + row.rel_ci[0], 1.0 + row.rel_ci[1]


def compare_configurations(configs: Sequence[Mapping[str, Any]], output_dir: str, n_boot: int = 1000,
                           seed: int = 0) -> list[dict]:
    """Each configuration after the first against the first, at every level both measured."""
    names = labels(configs)
    rows: list[dict] = []
    base = configs[0] if configs else None
    for j in range(1, len(configs)):
        cand = configs[j]
        base_pts = {p["concurrency"]: p for p in (base or {}).get("points") or []}
        for p in cand.get("points") or []:
            c = p["concurrency"]
            if c not in base_pts:
                continue
            a, b = _level_run(output_dir, base_pts[c]), _level_run(output_dir, p)
            if a is None or b is None:
                continue
            got = {r.metric: r for r in compare_runs([a], [b], VERDICT_METRICS, n_boot=n_boot, seed=seed)}
            row = {"concurrency": c, "baseline": names[0], "candidate": names[j], "metrics": {}}
            for m, r in got.items():
                ratio, lo, hi = _ratio(r)
                row["metrics"][m] = {"a": r.a, "b": r.b, "ratio": ratio, "ratio_ci": [lo, hi], "verdict": r.verdict}
            row["verdict"], row["sentence"] = verdict(names[j], names[0], c, row["metrics"].get("output_throughput"))
            rows.append(row)
    return rows


def verdict(candidate: str, baseline: str, c: int, thr: Mapping[str, Any] | None) -> tuple[str, str]:
    """("faster" | "slower" | "same" | "no interval", the sentence saying it) for output tok/s at level C."""
    base = short_value(baseline)
    if thr is None:
        return "no interval", f"{candidate} vs {base} at C={c}: no output throughput to compare"
    lo, hi = thr["ratio_ci"]
    if hi - lo < 1e-9 * max(abs(hi), 1.0) and abs(thr["ratio"] - 1.0) >= MIN_EFFECT:
        # every request made the same number of tokens: resampling them cannot vary the throughput
        return "no interval", (f"{candidate} measured {thr['ratio']:.2f}× the output tok/s of {base} at C={c}, with no "
                               f"interval (equal output lengths; vary them with --random-range-ratio < 1)")
    if lo <= 1.0 <= hi or abs(thr["ratio"] - 1.0) < MIN_EFFECT:
        return "same", f"{candidate} vs {base}: no difference in output tok/s at C={c}"
    kind = "faster" if thr["ratio"] > 1.0 else "slower"
    return kind, f"{candidate} is {thr['ratio']:.2f}× [{lo:.2f}, {hi:.2f}] the output tok/s of {base} at C={c}"


def headline(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per candidate: its differences level by level (largest C first), then the levels with
    no difference, then those without an interval."""
    out = []
    for cand in dict.fromkeys(r["candidate"] for r in rows):
        mine = sorted((r for r in rows if r["candidate"] == cand), key=lambda r: -r["concurrency"])
        parts = [r["sentence"] for r in mine if r["verdict"] in ("faster", "slower")]
        same = [r["concurrency"] for r in sorted(mine, key=lambda r: r["concurrency"]) if r["verdict"] == "same"]
        if same:
            parts.append("no difference at " + ", ".join(f"C={c}" for c in same))
        parts += [r["sentence"] for r in mine if r["verdict"] == "no interval"]
        # equal throughput can still hide a latency difference a user would feel: say it where its interval
        # leaves 1 out (e.g. decode steps faster while prefill-bound steps set the throughput)
        parts += [s for r in sorted(mine, key=lambda r: r["concurrency"]) if r["verdict"] == "same"
                  and (s := _tpot_note(r["concurrency"], (r.get("metrics") or {}).get("tpot_p50")))]
        out.append("; ".join(parts))
    return out


def _tpot_note(c: int, tpot: Mapping[str, Any] | None) -> str | None:
    """"median TPOT 0.93× [0.92, 0.95] at C=64" where the TPOT ratio's interval excludes 1, else None."""
    if not tpot:
        return None
    lo, hi = tpot["ratio_ci"]
    if lo <= 1.0 <= hi or abs(tpot["ratio"] - 1.0) < MIN_EFFECT or hi - lo < 1e-9:
        return None
    return f"median TPOT {tpot['ratio']:.2f}× [{lo:.2f}, {hi:.2f}] at C={c}"
