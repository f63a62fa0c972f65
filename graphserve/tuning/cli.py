"""`graphserve tune`: measure, on the card it runs on, every table the engine reads (gemv routing, FP8 routes
and tiles, MLA decode tiles, MoE expert tiles, the FP4 rule, the dense FP4 GEMM's tiles and FP4 expert tiles) for the
models named, and write them to the per-user cache (kernels/tables.py), which the engine reads before the shipped
tables.

    graphserve tune                                  # the presets the shipped tables cover, each table <= --budget-s
    graphserve tune --quick                          # two presets, fewer row counts and tiles: a few minutes
    graphserve tune --model dummy:qwen3-30b-a3b --tables gemv moe
    graphserve tune --tables moe --experts 128 --hidden 2048 --intermediate 768 --top-k 8 --dtype bfloat16
    graphserve tune --out graphserve/kernels/tables  # a source checkout's shipped tables for this card
    graphserve tune --tables fp4 --model dummy:deepseek-v4-flash-l6   # the FP4 rule and FP4 experts' tiles
    graphserve tune --tables fp4 --model dummy:llama3-8b --quick      # the FP4 rule and the dense FP4 GEMM's tiles
"""

from __future__ import annotations

import argparse
from pathlib import Path

from graphserve.errors import ConfigError

TABLES = ("gemv", "fp8", "mla", "moe", "fp4")
BUDGET_S = 300.0  # per table: a full MoE sweep of one expert shape takes 5-8 minutes on an H200
QUICK_BUDGET_S = 35.0  # five tables of about this, plus one unit each past it: under ~4 minutes
MOE_DTYPES = ("bfloat16", "float16", "float8_e4m3fn")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "--models", dest="models", nargs="+", metavar="MODEL", default=None,
                   help="dummy: presets whose shapes to measure (default: the presets the shipped tables cover; "
                        "--quick: dummy:llama3-8b and dummy:qwen3-30b-a3b)")  # fmt: skip
    p.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES), metavar="TABLE",
                   help=f"which tables to measure, of {', '.join(TABLES)} (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer row counts and tiles, a shorter budget per table")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"seconds per table (default {BUDGET_S:.0f}, --quick {QUICK_BUDGET_S:.0f}); the table is "
                        f"written with what was measured by then, one unit at most past it")  # fmt: skip
    p.add_argument("--out", type=Path, default=None,
                   help="write to OUT/<card>/ instead of the per-user cache (a source checkout's shipped tables: "
                        "graphserve/kernels/tables)")  # fmt: skip
    g = p.add_argument_group("one more MoE expert shape (with --tables moe)")
    g.add_argument("--experts", type=int)
    g.add_argument("--hidden", type=int)
    g.add_argument("--intermediate", type=int, help="one expert's intermediate size on this rank")
    g.add_argument("--top-k", type=int, default=8)
    g.add_argument("--dtype", choices=MOE_DTYPES, default=None,
                   help="the experts' dtype (default: bfloat16, and float8_e4m3fn without --quick)")


def check_args(args: argparse.Namespace) -> tuple[list[str], float, list[tuple[int, int, int, int]]]:
    """The models (dummy:-prefixed), the budget per table and the extra expert shapes, or a ConfigError naming
    the flag, its value and the limit."""
    from graphserve.models.presets import PRESETS
    from graphserve.tuning.measure import DEFAULT_MODELS, QUICK_MODELS

    models = [m if m.startswith("dummy:") else f"dummy:{m}" for m in args.models or ()]
    unknown = [m for m in models if m.removeprefix("dummy:") not in PRESETS]
    if unknown:
        raise ConfigError(f"--model {unknown[0]} is not a preset: choose among "
                          f"{', '.join('dummy:' + p for p in sorted(PRESETS))}", param="model")  # fmt: skip
    models = models or list(QUICK_MODELS if args.quick else DEFAULT_MODELS)
    budget = args.budget_s if args.budget_s is not None else (QUICK_BUDGET_S if args.quick else BUDGET_S)
    if not budget > 0:
        raise ConfigError(f"--budget-s {args.budget_s} is invalid: seconds per table, > 0", param="budget_s")
    shape = (args.experts, args.hidden, args.intermediate)
    shapes = []
    if any(v is not None for v in shape):
        if None in shape:
            raise ConfigError("an expert shape needs all of --experts, --hidden and --intermediate", param="experts")
        for flag, value in (("--experts", args.experts), ("--hidden", args.hidden),
                            ("--intermediate", args.intermediate), ("--top-k", args.top_k)):  # fmt: skip
            if value < 1:
                raise ConfigError(f"{flag} {value} is invalid: must be >= 1", param=flag[2:].replace("-", "_"))
        if args.top_k > args.experts:
            raise ConfigError(f"--top-k {args.top_k} exceeds --experts {args.experts}", param="top_k")
        if "moe" not in args.tables:
            raise ConfigError("--experts/--hidden/--intermediate describe a MoE table: add moe to --tables",
                              param="tables")
        shapes.append((args.experts, args.hidden, args.intermediate, args.top_k))
        if not args.models:  # an expert shape alone: that table only, not the default presets' as well
            models = []
    return models, budget, shapes


def run(args: argparse.Namespace) -> int:
    models, budget, shapes = check_args(args)
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("graphserve tune measures the GPU it runs on, and no CUDA device is visible", param="device")
    from graphserve.kernels import tables
    from graphserve.tuning.measure import build_plans
    from graphserve.tuning.runner import output_dir, run_table

    card = torch.cuda.get_device_name(0)
    out = output_dir(args.out, card)
    dtypes = (args.dtype,) if args.dtype else None
    plans = build_plans(args.tables, models, args.quick, shapes, dtypes)
    target = ", ".join(models) or "the expert shape"
    print(f"tuning {', '.join(p.table for p in plans) or 'nothing'} for {target} on {card}, "
          f"at most {budget:.0f} s a table; tables go to {out}", flush=True)
    reports = [run_table(plan, budget, out, card) for plan in plans]
    for report in reports:
        print(report.line())
    tables.clear()
    if not plans:
        print(f"no table of {', '.join(args.tables)} has shapes of {', '.join(models)}: nothing measured")
        return 1
    return 0 if any(r.files for r in reports) else 1
