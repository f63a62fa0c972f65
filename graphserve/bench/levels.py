"""One server, every concurrency level in turn: the load at each level, its steady state, and the scaling
fits over the levels and over the server's step telemetry. sweep.py runs it against one server,
server_grid.py against each configuration of a grid."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Callable
from typing import Any

from graphserve.bench.client import bench_once
from graphserve.bench.scrape import fetch_telemetry, healthy
from graphserve.bench.steady import steady_point
from graphserve.errors import GraphserveError


def prompts_for_level(c: int, per_level: int) -> int:
    return max(per_level, 5 * c)


def _fit(kind: str, data: Any) -> tuple[dict | None, str | None]:
    """Scaling fit via analysis.scaling: (fit dict, None), or (None, why) when it cannot be fitted."""
    from graphserve.analysis import scaling

    try:
        fit = scaling.fit_from_sweep(data) if kind == "sweep" else scaling.fit_from_telemetry(data)
    except GraphserveError as e:
        return None, e.message
    return fit.to_dict(), None


def sweep_levels(args: argparse.Namespace, base_url: str, levels: list[int], output_dir: str,
                 alive: Callable[[], bool] | None = None, tokenizer: Any = None, label: str = "") -> dict:
    """Run every level against one server; stop at the first level the server does not survive."""
    os.makedirs(os.path.join(output_dir, "levels"), exist_ok=True)
    points: list[dict] = []
    telemetry: list[dict] | None = None
    seen = fetch_telemetry(base_url, since=-1)
    last_step = max((r.get("step", 0) for r in seen), default=0) if seen is not None else 0
    if seen is not None:
        telemetry = []
    failed_at = None
    for c in levels:
        res = bench_once(args, base_url, prompts_for_level(c, args.num_prompts_per_level), tokenizer,
                         request_rate=math.inf, max_concurrency=c)
        result_file = os.path.join("levels", f"{label}c{c}.json")
        with open(os.path.join(output_dir, result_file), "w", encoding="utf-8") as f:
            json.dump(res, f)
        point = steady_point(res["requests"], c)
        s = res["summary"]
        point.update({"summary": s, "result_file": result_file, "output_throughput_run": s["output_throughput"],
                      "ttft_ms_median": (s["ttft_ms"] or {}).get("median"),
                      "tpot_ms_median_run": (s["tpot_ms"] or {}).get("median"),
                      "e2e_ms_median": (s["e2e_ms"] or {}).get("median"),
                      "client_limited": res["client_health"]["client_limited"],
                      "failure_reasons": s["failure_reasons"]})
        if (getattr(args, "profile", False) or getattr(args, "breakdown", False)) and not point["failed"]:
            from graphserve.analysis.profile import profile_level

            point["profile"] = profile_level(base_url, c, profile_steps(args), args.random_input_len,
                                             os.path.join(output_dir, "profiles", f"{label}c{c}"), output_dir)
        points.append(point)
        print(_level_line(point), flush=True)
        if telemetry is not None:
            recs = fetch_telemetry(base_url, since=last_step) or []
            telemetry.extend(recs)
            last_step = max((r.get("step", 0) for r in recs), default=last_step)
        if point["failed"] and not (alive() if alive else healthy(base_url)):
            failed_at = c
            break
    out: dict[str, Any] = {"points": points, "failed_at": failed_at}
    out["fit"], out["fit_error"] = _fit("sweep", points)
    decode = [r for r in telemetry or [] if r.get("kind") == "decode"]
    out["telemetry_fit"], out["telemetry_fit_error"] = _fit("telemetry", telemetry) if decode else (None, None)
    out["telemetry_steps"] = len(decode)
    # What the fit's quality is judged on (analysis/grid_compare.fit_quality): how many batch sizes it
    # saw and how much of the window was not decode.
    out["telemetry_distinct_batch_sizes"] = len({r.get("batch_size") for r in decode})
    out["telemetry_non_decode_share"] = (1.0 - len(decode) / len(telemetry)) if telemetry else None
    out["telemetry_host_share"] = host_share(telemetry or [])
    if getattr(args, "breakdown", False):
        from graphserve.analysis.slope_breakdown import fit_breakdown

        out["breakdown"] = fit_breakdown(points, out["fit"])
    return out


def profile_steps(args: argparse.Namespace) -> int:
    """Steps traced per level: --profile's own count, or with --breakdown alone the few its fit needs."""
    if getattr(args, "profile", False):
        return args.profile_steps
    from graphserve.analysis.slope_breakdown import BREAKDOWN_STEPS

    return BREAKDOWN_STEPS


def host_share(records: list[dict]) -> dict[str, float | None]:
    """Per step kind, the median share of a step's time the host spent enqueueing it (``launch_ms`` over
    ``step_ms``): near 1, the device waited on the host's launches. None where no record has both (a server
    older than the field, or no step of that kind)."""
    out: dict[str, float | None] = {}
    for kind in ("decode", "prefill", "mixed"):
        shares = [r["launch_ms"] / r["step_ms"] for r in records
                  if r.get("kind") == kind and r.get("step_ms", 0) > 0 and "launch_ms" in r]
        out[kind] = statistics.median(shares) if shares else None
    return out


def _level_line(p: dict) -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    return (f"C={p['concurrency']:<4} done {p['completed']}/{p['num_requests']}  achieved {f(p.get('achieved_concurrency'), '.2f')}"
            f"  steady TPOT {f(p.get('tpot_ms_median'), '.2f')} ms  {f(p.get('output_throughput'), '.1f')} tok/s")
