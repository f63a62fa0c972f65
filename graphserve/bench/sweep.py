"""`graphserve sweep`: the load generator at each concurrency, the steady state of each level, and
the scaling fit step_time(N) = a + b·N over them (and over the server's own step telemetry when it
exposes /v1/telemetry), written as a report folder. With --server-cmd and --server-grid it does
this for every server configuration in turn (see server_grid.py) and compares each with the first,
level by level (analysis/grid_compare.py). With --profile, after each level the same number of
requests is held in decode and their steps profiled (graphserve profile), beside the level's numbers
rather than during them. With --breakdown, a few such steps per level are traced and each category's ms
per step is fitted against N like the total (analysis/slope_breakdown.py): how much of b is attention."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from graphserve.bench.client import (
    add_target_arguments,
    check_load_args,
    environment,
    load_tokenizer,
    target_server,
)
from graphserve.bench.levels import sweep_levels
from graphserve.bench.server_grid import run_configurations
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
    g.add_argument("--breakdown", action="store_true",
                   help="after each level, trace a few decode steps of C held requests and fit each category's ms "
                        "(attention, MoE, GEMMs...) against N like the total, so the report says how much of b each "
                        "takes; the server must run with --enable-profile-endpoint")


@contextlib.contextmanager
def _target(args: argparse.Namespace) -> Iterator[str]:
    """target_server, except that an in-process server started for --profile or --breakdown exposes the profile
    endpoint."""
    if not ((args.profile or args.breakdown) and args.model and not args.base_url):
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


def _quality(cfg: dict, key: str) -> dict:
    from graphserve.analysis.grid_compare import fit_quality

    if key == "fit":
        return fit_quality(cfg["fit"], int(cfg["fit"].get("n_points") or 0))
    return fit_quality(cfg[key], int(cfg.get("telemetry_distinct_batch_sizes") or 0), cfg.get("telemetry_non_decode_share"))


def print_results(results: dict) -> None:
    from graphserve.analysis.report import doctor_text, format_table, host_share_text
    from graphserve.analysis.report_text import fit_text
    from graphserve.analysis.slope_breakdown import breakdown_lines

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
        for line in breakdown_lines(cfg.get("breakdown")):
            print(f"breakdown: {line}")
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
        if args.profile or args.breakdown:  # refused here, not once per level after each level's load has run
            from graphserve.analysis.profile import check_steps
            from graphserve.bench.levels import profile_steps

            check_steps(profile_steps(args))
        levels = parse_levels(args.concurrency)
        output_dir = args.output_dir or "sweep-" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        tokenizer = load_tokenizer(args.tokenizer)
        results: dict[str, Any] = {"config": run_config(args, levels), "environment": environment()}
        if args.server_cmd:
            from graphserve.analysis.grid_compare import compare_configurations

            results["configurations"] = run_configurations(args, levels, output_dir, tokenizer)
            first = next((c for c in results["configurations"] if c.get("points")), None)
            results.update({k: (first or {}).get(k) for k in ("points", "fit", "telemetry_fit", "failed_at")})
            results["points"] = results["points"] or []
            if (first or {}).get("breakdown"):
                results["breakdown"] = first["breakdown"]
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
