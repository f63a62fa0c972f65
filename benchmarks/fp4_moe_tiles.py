"""FP4 routed experts per preset shape and batch: the streaming path, the grouped GEMM's bf16 variant at its default
tile and at its best, and the fp8 (W4A8) variant at its best, each as ms, GB/s of the expert bytes the batch touches
and the ratio to the same run's read floor (benchmarks/roofline.py's probe, before and after). The sweep is
graphserve/tuning/fp4_moe.py's, which `graphserve tune --tables fp4` runs; this writes its rows to
benchmarks/results/fp4_moe_tiles.json (and, with --write-table, the table into the source tree's per-card folder).

Run: python3 -m benchmarks.fp4_moe_tiles [--model deepseek-v4-flash-l6 ...] [--tokens 1 4 16 64 256] [--quick]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import write_result
from graphserve.kernels import tables
from graphserve.tuning import fp4_moe
from graphserve.tuning.roofline import measured_read_bw
from graphserve.tuning.runner import write_json
from graphserve.tuning.timing import environment, print_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=list(fp4_moe.SHAPES), choices=list(fp4_moe.SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=None, help="batches (default 1 4 16 64 256)")
    ap.add_argument("--quick", action="store_true", help="4 tiles a variant, batches 1 16 64")
    ap.add_argument("--budget-s", type=float, default=600.0, help="seconds a shape (its later batches left out)")
    ap.add_argument("--write-table", action="store_true",
                    help="write graphserve/kernels/tables/<card>/fp4_moe_tiles.json from these measurements")
    args = ap.parse_args()
    card = torch.cuda.get_device_name(0)
    bw = measured_read_bw()
    measured = {}
    for name in args.model:
        measured[name] = fp4_moe.measure_shape(name, args.budget_s, args.quick, tuple(args.tokens or ()) or None)
    bw.probe_again()
    rows = fp4_moe.bench_rows([r for rs in measured.values() for r in rs], bw.floor_ms)
    table = fp4_moe.table_from(measured, None, card)
    # a kernel that did not compile or run on this card has no row (its timing was inf)
    write_result("fp4_moe_tiles", {"read_bw": bw.summary(), "card": card, "rows": rows, "table": table})
    if args.write_table:
        path = tables.SHIPPED_DIR / tables.card_key(card) / fp4_moe.TABLE_FILE
        write_json(path, {**table, **tables.stamp(card), "measured_at": environment(),
                          "written_by": "benchmarks/fp4_moe_tiles.py"})  # fmt: skip
        print(f"wrote {path}")
    print_table(rows, ["model", "tokens", "pairs", "kernel", "ms", "gbs", "ratio"])
    print(f"read bw {bw.best_gbs:.0f} GB/s ({bw.best_method})")


if __name__ == "__main__":
    main()
