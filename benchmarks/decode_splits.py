"""Decode attention by split count, bf16 and fp8 (e4m3) caches: what ``choose_num_splits`` picks against every
count it could have picked.

For Llama-3-8B's heads (32 query, 8 kv, head_dim 128) at context 2048 and Qwen3-30B-A3B's (32 / 4) at context
1024, batches 1 to 256: each split count timed as one call's share of a CUDA graph of back-to-back calls. A
layer's cache at batch 16 and up is larger than the L2, so those reads come from HBM; the smaller ones may not,
and their rows show the split choice, not a bandwidth. ``ratio`` is the time against the cache bytes at the
best read bandwidth of the run (benchmarks/roofline.py probes, and these rows where the cache is over 256 MB).

Run on a GPU: python3 -m benchmarks.decode_splits   (writes benchmarks/results/decode_splits.json: every row, and
a summary per shape, cache and batch; ``--summarize FILE`` derives the summary of an earlier run's rows).
``--shapes``, ``--batches`` and ``--ctx`` narrow the grid (``--ctx`` sets every shape's context), ``--tiles`` times
other launch shapes than the one decode_attention runs, ``--tables`` how the pages lie: ``random`` (a shuffled pool, the default) or
``contiguous`` (each sequence's pages in order, one sequence after the other, as a fresh pool hands them out),
``--result-name`` writes another file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import print_table, write_result
from benchmarks.kernels import graph_time_ms
from benchmarks.roofline import measured_read_bw
from graphserve.kernels.common import sm_count
from graphserve.kernels.decode_attention import DecodeTile, decode_attention, decode_plan
from graphserve.kernels.fp8_quant import FP8_DTYPE

PAGE = 16
SHAPES = {"llama3-8b": (32, 8, 128, 2048), "qwen3-30b-a3b": (32, 4, 128, 1024)}  # q heads, kv heads, dim, ctx
BATCHES = [1, 4, 16, 32, 64, 128, 256]
SPLITS = [1, 2, 3, 4, 6, 8, 16, 32]
CACHES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
TABLES = ("random", "contiguous")
L2_SAFE_BYTES = 256 << 20
COLS = ["shape", "cache", "tables", "bs", "ctx", "tile", "splits", "picked", "us", "floor_us", "ratio"]
SUMMARY_COLS = ["shape", "cache", "tables", "bs", "ctx", "picked", "picked_us", "best_tile", "best", "best_us",
                "picked/best"]


def parse_tile(text: str) -> DecodeTile:
    """``BLOCK_N,WARPS,STAGES`` as a checked DecodeTile."""
    try:
        tile = DecodeTile(*(int(v) for v in text.split(",")))
        tile.validate()
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--tiles {text!r}: BLOCK_N,WARPS,STAGES ({e})") from e
    return tile


def measure(name: str, cache_name: str, batch: int, sms: int, tiles: list[DecodeTile] | None = None,
            ctx: int | None = None, tables_kind: str = "random") -> list[dict]:
    hq, hkv, d, shape_ctx = SHAPES[name]
    ctx = ctx or shape_ctx
    width = ctx // PAGE + 1  # the block table one block wider than the context, as a decode step's
    cache = torch.randn(2, batch * width + 1, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16).to(CACHES[cache_name])
    pages = torch.randperm(batch * width, device="cuda") if tables_kind == "random" else \
        torch.arange(batch * width, device="cuda")
    tables = (pages.int() + 1).view(batch, width)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(batch * hkv, dtype=torch.int32, device="cuda")
    fp8 = cache.dtype == FP8_DTYPE
    picked_tile, picked = decode_plan(batch, hkv, width * PAGE, sms, fp8)
    nbytes = batch * ctx * hkv * d * 2 * cache.element_size()
    rows = []
    for tile in tiles or [picked_tile]:
        for splits in sorted({*SPLITS, picked}):
            if splits > -(-width * PAGE // tile.block_n):  # more splits than inner steps: the extra ones hold nothing
                continue
            us = graph_time_ms(lambda s=splits, t=tile: decode_attention(q, cache, tables, lens, d**-0.5, num_splits=s,
                                                                         counters=counters, tile=t)) * 1e3  # fmt: skip
            chosen = splits == picked and tile == picked_tile
            rows.append({"shape": name, "cache": cache_name, "tables": tables_kind, "bs": batch, "ctx": ctx,
                         "tile": tile.label(), "splits": splits, "picked": chosen, "us": us, "bytes": nbytes})
            print(f"  {name} {cache_name} {tables_kind} bs={batch} tile={tile.label()} splits={splits}"
                  f"{' (picked)' if chosen else ''}: {us:.2f} us", flush=True)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per shape, cache and batch: the count the rule picked and the fastest count timed, and their times."""
    out = {}
    for r in rows:
        tables = r.get("tables", "random")
        key = (r["shape"], r["cache"], tables, r["bs"])
        s = out.setdefault(key, {"shape": r["shape"], "cache": r["cache"], "tables": tables, "bs": r["bs"],
                                 "ctx": r["ctx"]})
        if r["picked"]:
            s.update(picked=r["splits"], picked_us=r["us"])
        if "best_us" not in s or r["us"] < s["best_us"]:
            s.update(best_tile=r.get("tile", "default"), best=r["splits"], best_us=r["us"])
    for s in out.values():
        s["picked/best"] = s["picked_us"] / s["best_us"]
    return list(out.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--summarize", metavar="FILE", help="add the summary to a results file this module wrote, "
                                                        "from its own rows, and measure nothing")
    p.add_argument("--tiles", nargs="+", type=parse_tile, metavar="BLOCK_N,WARPS,STAGES",
                   help="launch shapes to time (default: the one decode_attention runs)")
    p.add_argument("--tables", nargs="+", choices=TABLES, default=["random"], help="how each sequence's pages lie")
    p.add_argument("--caches", nargs="+", choices=sorted(CACHES), default=sorted(CACHES))
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=BATCHES)
    p.add_argument("--ctx", type=int, help="context of every row (default: each shape's own)")
    p.add_argument("--result-name", default="decode_splits", help="benchmarks/results/NAME.json")
    args = p.parse_args()
    if args.summarize:
        path = Path(args.summarize)
        data = json.loads(path.read_text())
        data["summary"] = summary(data["rows"])
        path.write_text(json.dumps(data, indent=1))
        print_table(data["summary"], SUMMARY_COLS)
        return
    sms = sm_count(torch.device("cuda"))
    bw = measured_read_bw()
    rows = [r for name in args.shapes for cache in args.caches for kind in args.tables for b in args.batches
            for r in measure(name, cache, b, sms, args.tiles, args.ctx, kind)]
    for r in rows:
        if r["bytes"] > L2_SAFE_BYTES:  # a cache the L2 could hold would report the L2's rate as HBM's
            bw.observe(f"decode attention {r['shape']} {r['cache']} bs={r['bs']} splits={r['splits']}", r["bytes"],
                       r["us"] / 1e3)
    for r in rows:
        r["floor_us"] = bw.floor_ms(r["bytes"]) * 1e3
        r["ratio"] = r["us"] / r["floor_us"]
    print(f"floor: {bw.describe()}")
    picks = summary(rows)
    print_table(rows, COLS)
    print_table(picks, SUMMARY_COLS)
    write_result(args.result_name, {"read": bw.summary(), "rows": rows, "summary": picks})


if __name__ == "__main__":
    main()
