"""The dense FP4 GEMM per preset projection and rows: the streaming kernel, each variant at the card's default tile
and at its best tile, as ms, GB/s of the kernel's fewest bytes, TFLOP/s and the ratio to the same run's read floor
(benchmarks/roofline.py's probe, before and after). The sweep is graphserve/tuning/fp4_gemm.py's, which
`graphserve tune --tables fp4` runs; this writes its rows to benchmarks/results/fp4_gemm_tiles.json (and, with
--write-table, the tile table and the FP4 rule from the same timings into the source tree's per-card folder).

Run: python3 -m benchmarks.fp4_gemm_tiles [--model dummy:llama3-8b dummy:gpt-oss-20b] [--rows 16 64 4096] [--quick]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import write_result
from graphserve.kernels import tables
from graphserve.kernels.common import sm_count
from graphserve.tuning import fp4, fp4_gemm
from graphserve.tuning.measure import FP4_DENSE_MODELS, fp4_dense_units
from graphserve.tuning.roofline import measured_read_bw
from graphserve.tuning.runner import write_json
from graphserve.tuning.timing import environment, print_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=list(FP4_DENSE_MODELS), help="dummy: presets (their dense shapes)")
    ap.add_argument("--rows", nargs="+", type=int, default=None, help=f"row counts (default {fp4_gemm.ROWS})")
    ap.add_argument("--quick", action="store_true", help=f"{fp4_gemm.QUICK_CANDIDATES} tiles a variant, fewer rows")
    ap.add_argument("--budget-s", type=float, default=600.0, help="seconds a projection (its later rows left out)")
    ap.add_argument("--write-table", action="store_true",
                    help="write graphserve/kernels/tables/<card>/fp4_gemm_tiles.json and fp4_rule.json")
    args = ap.parse_args()
    if args.rows:
        fp4_gemm.ROWS = fp4_gemm.QUICK_ROWS = tuple(args.rows)
    device = torch.device("cuda")
    card, sms = torch.cuda.get_device_name(device), sm_count(device)
    bw = measured_read_bw()
    rows = []
    for unit in fp4_dense_units([m if m.startswith("dummy:") else f"dummy:{m}" for m in args.model]):
        _, model, proj = unit.split()
        rows += fp4_gemm.measure_projection(model, proj, args.budget_s, args.quick, sms, card)
    bw.probe_again()
    table = fp4_gemm.table_from(rows, None, card)
    rule = fp4.derive_rule(rows, card)
    printed = fp4_gemm.bench_rows(rows, bw.floor_ms)
    write_result("fp4_gemm_tiles", {"read_bw": bw.summary(), "card": card, "rows": printed, "measured": rows,
                                    "table": table, "rule": rule, "errors": fp4.ERRORS})  # fmt: skip
    if args.write_table and table is not None:
        for name, data in ((fp4_gemm.TABLE_FILE, table), ("fp4_rule.json", rule)):
            path = tables.SHIPPED_DIR / tables.card_key(card) / name
            write_json(path, {**data, **tables.stamp(card), "measured_at": environment(),
                              "written_by": "benchmarks/fp4_gemm_tiles.py"})  # fmt: skip
            print(f"wrote {path}")
    print_table(printed, ["model", "proj", "fmt", "m", "kernel", "tile", "ms", "gbs", "tflops", "ratio"])
    print(f"read bw {bw.best_gbs:.0f} GB/s ({bw.best_method})")


if __name__ == "__main__":
    main()
