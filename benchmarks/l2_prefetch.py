"""The next projection's weight warmed in L2 from the tail of the one before (kernels/l2_prefetch.py), by budget.

For each FP8 model and batch size: one model load, one CUDA-graph capture of the decode step per budget
(``l2_prefetch(mb)``; 0 is off), replayed in turns for ``--rounds`` rounds (benchmarks/pdl.py
``timed_captures``: clock and thermal drift fall on every variant alike); each variant's time is the median
of its rounds. MoE models route uniformly. The floor is the bytes the step must read over the best read
bandwidth measured in this run (benchmarks/roofline.py); the last columns are each variant's ratio to it.

Run: python3 -m benchmarks.l2_prefetch [--models dummy:llama3-8b] [--bs 1] [--ctx 512] [--mb 0 8 16 32]
"""

from __future__ import annotations

import argparse

from benchmarks.common import print_table, write_result
from benchmarks.pdl import timed_captures
from benchmarks.roofline import measured_read_bw
from graphserve.kernels.l2_prefetch import l2_prefetch


def label(mb: float) -> str:
    return "off" if mb == 0 else f"{mb:g} MB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["dummy:llama3-8b"], help="run with --quantization fp8")
    p.add_argument("--bs", nargs="+", type=int, default=[1])
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--mb", nargs="+", type=float, default=[0, 8, 16, 32], help="budgets per link, MB (0: off)")
    p.add_argument("--variant", action="append", default=[], metavar="MB,MODE,LINKS",
                   help="one more capture: MB budget, mode bulk|lines, links all|attention")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--result-name", default="l2_prefetch", help="benchmarks/results/NAME.json")
    args = p.parse_args()
    for name in ("rounds", "ctx"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} is invalid: must be >= 1")
    if min(args.bs) < 1:
        p.error(f"--bs {args.bs} is invalid: every batch size must be >= 1")
    if min(args.mb) < 0 or max(args.mb) > 1024 or 0 not in args.mb:
        p.error(f"--mb {args.mb} is invalid: budgets in 0..1024 MB, and 0 (off, the baseline) among them")
    bw = measured_read_bw()
    print(bw.describe())
    scopes = {label(mb): (lambda mb=mb: l2_prefetch(mb)) for mb in sorted(set(args.mb))}
    for spec in args.variant:
        mb, mode, links = spec.split(",")
        scopes[spec] = lambda mb=float(mb), mode=mode, links=links: l2_prefetch(mb, mode, links)
    rows = []
    for m in args.models:
        rows += timed_captures(m, "fp8", args.bs, args.ctx, args.rounds, bw, scopes)
    cols = ["model", "bs", "ctx", *scopes, "floor_ms", *(f"ratio {k}" for k in scopes)]
    for r in rows:  # every row against the best rate of the whole run
        r["floor_ms"] = bw.floor_ms(r["bytes"])
        for k, ms in r["variants_ms"].items():
            r[k] = ms
            r[f"ratio {k}"] = ms / r["floor_ms"]
    print_table(rows, cols)
    write_result(args.result_name, {"read_bandwidth": bw.summary(), "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
