"""`graphserve sweep`: the load generator at each concurrency, the steady state of each level, and
the scaling fit step_time(N) = a + b·N over them (and over the server's own step telemetry when it
exposes /v1/telemetry), written as a report folder. With --server-cmd and --server-grid it does
this for every server configuration in turn (see server_grid.py) and compares each with the first,
level by level (analysis/grid_compare.py). With --profile, after each level the same number of
requests is held in decode and their steps profiled (graphserve profile), beside the level's numbers
rather than during them."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any

from graphserve.bench.client import (
    add_target_arguments,
    bench_once,
    check_load_args,
    environment,
    load_tokenizer,
    target_server,
)
from graphserve.bench.scrape import fetch_telemetry, healthy
from graphserve.bench.steady import steady_point
from graphserve.errors import GraphserveError, bad_field

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    g = parser.add_argument_group("sweep")
    g.add_argument("--concurrency", default=",".join(map(str, DEFAULT_LEVELS)), help="levels, e.g. 1,2,4,8")
    g.add_argument("--num-prompts-per-level", type=int, default=16,
                   help="requests per level; raised to 5*C at level C so each level reaches steady state")
    g.add_argument("--output-dir", default=None, help="report folder (default: sweep-<UTC time>)")
    g.add_argument("--server-cmd", default=None,
                   help='server command with placeholders, e.g. "graphserve serve M --port {port} '
                        '--cuda-graph-max-bs {cuda_graph_max_bs}"')
    g.add_argument("--server-grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="values for one placeholder of --server-cmd; repeat for more keys")
    g.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for /health")
    g.add_argument("--profile", action="store_true",
                   help="after each level, hold C requests in decode and profile their steps (graphserve profile); "
                        "the server must run with --enable-profile-endpoint")
    g.add_argument("--profile-steps", type=int, default=10, help="decode steps per profile")


@contextlib.contextmanager
def _target(args: argparse.Namespace) -> Iterator[str]:
    """target_server, except that an in-process server started for --profile exposes the profile endpoint."""
    if not (args.profile and args.model and not args.base_url):
        with target_server(args) as url:
            yield url
        return
    from graphserve.config import config_from_args
    from graphserve.server.launch import ServerThread

    with ServerThread(config_from_args(args, args.model), enable_profile_endpoint=True) as server:
        yield server.base_url


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise bad_field("concurrency", text, "must be comma-separated integers, e.g. 1,2,4,8") from None
    if not levels or min(levels) < 1:
        raise bad_field("concurrency", text, "needs at least one level, each >= 1")
    return sorted(set(levels))


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
        if getattr(args, "profile", False) and not point["failed"]:
            from graphserve.analysis.profile import profile_level

            point["profile"] = profile_level(base_url, c, args.profile_steps, args.random_input_len,
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
    return out


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


def _quality(cfg: dict, key: str) -> dict:
    from graphserve.analysis.grid_compare import fit_quality

    if key == "fit":
        return fit_quality(cfg["fit"], int(cfg["fit"].get("n_points") or 0))
    return fit_quality(cfg[key], int(cfg.get("telemetry_distinct_batch_sizes") or 0), cfg.get("telemetry_non_decode_share"))


def print_results(results: dict) -> None:
    from graphserve.analysis.report import doctor_text, format_table, host_share_text
    from graphserve.analysis.report_text import fit_text

    for cfg in results.get("configurations") or [results]:
        if cfg.get("params"):
            print(f"\n== {cfg['params']} ({cfg['status']}) ==")
        print(format_table(cfg["points"]))
        for key in ("fit", "telemetry_fit"):
            if cfg.get(key):
                print(f"{key}: {fit_text(cfg[key], _quality(cfg, key))}")
            elif cfg.get(key + "_error"):
                print(f"{key}: none ({cfg[key + '_error']})")
        if shares := host_share_text(cfg.get("telemetry_host_share")):
            print(shares)
        if cfg.get("failed_at"):
            print(f"server died at concurrency {cfg['failed_at']}")
        for d in cfg.get("diagnosis") or []:
            print(doctor_text(d))
    if results.get("comparison"):
        from graphserve.analysis.grid_compare import headline

        print("\n" + "\n".join(f"verdict: {h}" for h in headline(results["comparison"])))


def run(args: argparse.Namespace) -> int:
    try:
        check_load_args(args)
        if args.profile:  # refused here, not once per level after each level's load has run
            from graphserve.analysis.profile import check_steps

            check_steps(args.profile_steps)
        levels = parse_levels(args.concurrency)
        output_dir = args.output_dir or "sweep-" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        tokenizer = load_tokenizer(args.tokenizer)
        results: dict[str, Any] = {"config": run_config(args, levels), "environment": environment()}
        if args.server_cmd:
            from graphserve.analysis.grid_compare import compare_configurations
            from graphserve.bench.server_grid import run_configurations

            results["configurations"] = run_configurations(args, levels, output_dir, tokenizer)
            first = next((c for c in results["configurations"] if c.get("points")), None)
            results.update({k: (first or {}).get(k) for k in ("points", "fit", "telemetry_fit", "failed_at")})
            results["points"] = results["points"] or []
            results["comparison"] = compare_configurations(results["configurations"], output_dir)
        else:
            with _target(args) as base_url:
                results.update(sweep_levels(args, base_url, levels, output_dir, tokenizer=tokenizer))
    except GraphserveError as e:
        print(f"graphserve sweep: {e.message}", file=sys.stderr)
        return 2
    write_results(results, output_dir)
    print_results(results)
    print(f"results: {os.path.join(output_dir, 'results.json')}")
    return 0 if results.get("points") else 1


def run_config(args: argparse.Namespace, levels: list[int]) -> dict:
    """The settings the report shows: with --server-cmd the command template and grid, not the engine
    flags (they configure an in-process engine, which a --server-cmd sweep never starts)."""
    import dataclasses

    from graphserve.config import EngineConfig

    config = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    if args.server_cmd or args.base_url:
        for f in dataclasses.fields(EngineConfig):
            if f.name != "seed":  # the seed also drives the prompt sampler
                config.pop(f.name, None)
    if not args.server_cmd:
        config.pop("server_grid", None)
        config.pop("server_timeout", None)
    config["levels"] = levels
    return config


def write_results(results: dict, output_dir: str) -> dict:
    """The report folder (results.json, plots, Markdown/HTML) from analysis.report; a sweep without a
    single measured point still gets its results.json (configurations, log tails, diagnoses)."""
    from graphserve.analysis.report import write_report

    if results.get("points"):
        return {k: str(v) for k, v in write_report(results, output_dir).items()}
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "results.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=str)
    return {"results.json": path}
