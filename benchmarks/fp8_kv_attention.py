"""Decode attention alone on a bf16 and an fp8 (e4m3) KV cache, at Llama-3-8B's attention shape
(32 query heads, 8 kv heads, head_dim 128, 16-token pages): does reading half the bytes make the
kernel faster, and which widening of the fp8 values (fp16, the default; bf16, the earlier one) does.

Each cache runs at the split count and launch shape decode_attention picks for it (``decode_plan``: an fp8
cache has its own). Each time is one call's share of a CUDA graph of back-to-back calls, each on the next of ``LAYERS``
caches (a model's layers), so the KV comes from device memory as in a decode step. ``GBps``: the
KV bytes the call reads over its time; ``vs_floor``: time over those bytes at this run's read
bandwidth (benchmarks.roofline's probes).

Run: python3 -m benchmarks.fp8_kv_attention [--quick]   (about 1 minute on an H200)
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.common import print_table, write_result
from benchmarks.kernels import graph_time_ms
from benchmarks.roofline import measured_read_bw
from graphserve.kernels.common import sm_count
from graphserve.kernels.decode_attention import decode_attention, decode_plan

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
LAYERS = 32
CASES = [(1, 512), (1, 4096), (64, 2048), (256, 2048)]
QUICK_CASES = [(1, 512), (64, 2048)]
KINDS = {"bf16": (torch.bfloat16, torch.float16), "fp8 fp16-widen": (torch.float8_e4m3fn, torch.float16),
         "fp8 bf16-widen": (torch.float8_e4m3fn, torch.bfloat16)}


def measure(bs: int, ctx: int, bw) -> list[dict]:
    blocks = bs * ctx // PAGE
    layers = max(2, min(LAYERS, (1 << 31) // (blocks * PAGE * KV_HEADS * HEAD_DIM * 4)))  # <= 2 GB of bf16 KV
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(bs, ctx // PAGE)
    lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(bs, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    sms = sm_count(torch.device("cuda"))
    counters = torch.zeros(bs * KV_HEADS, dtype=torch.int32, device="cuda")
    rows = []
    for kind, (dtype, widen) in KINDS.items():
        fp8 = dtype == torch.float8_e4m3fn
        tile, splits = decode_plan(bs, KV_HEADS, ctx, sms, fp8)
        caches = [(torch.randn(2, blocks, PAGE, KV_HEADS, HEAD_DIM, device="cuda") * 0.5).to(dtype)
                  for _ in range(layers)]
        nbytes = 2 * bs * ctx * KV_HEADS * HEAD_DIM * caches[0].element_size()

        def call(pool=caches, step=itertools.count(), widen=widen, splits=splits):
            return decode_attention(q, pool[next(step) % len(pool)], tables, lens, HEAD_DIM**-0.5,
                                    num_splits=splits, counters=counters, fp8_widen=widen)

        us = graph_time_ms(call, calls=max(20, layers)) * 1e3
        bw.observe(f"decode attention {kind} bs={bs} ctx={ctx}", nbytes, us / 1e3)  # a floor none of them beats
        rows.append({"bs": bs, "ctx": ctx, "cache": kind, "splits": splits, "tile": tile.label(), "us": us,
                     "GBps": nbytes / us / 1e3, "bytes": nbytes})
        del caches, call
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="bs 1 ctx 512 and bs 64 ctx 2048 only")
    args = p.parse_args()
    bw = measured_read_bw()
    rows = [r for bs, ctx in (QUICK_CASES if args.quick else CASES) for r in measure(bs, ctx, bw)]
    for r in rows:  # against the best rate of the probes and of every row: known only once all have run
        r["vs_floor"] = r["us"] / (bw.floor_ms(r["bytes"]) * 1e3)
    print(f"read bandwidth: {bw.describe()}")
    print_table(rows, ["bs", "ctx", "cache", "splits", "tile", "us", "GBps", "vs_floor"])
    write_result("fp8_kv_attention", {"read": bw.summary(), "rows": rows})


if __name__ == "__main__":
    main()
