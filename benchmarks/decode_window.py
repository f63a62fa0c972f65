"""Sliding-window decode attention: what skipping the blocks before the window saves, against its floor.

Each row times decode attention (kernels/decode_attention.py) per layer under a CUDA graph of ``--layers``
back-to-back calls on distinct caches (reads from HBM, not an L2 warmed by the previous layer), at long contexts:
- Mistral-7B v0.1's heads (32/8, head_dim 128) with its 4096-token window, and without (v0.2);
- gpt-oss's heads (64/8, head_dim 64) with its 128-token window and sinks, and its full-attention layers.
The floor is the K/V bytes a row must read (the window's tokens, or the whole context without one) over the best
read bandwidth of the run: the probes' (benchmarks/roofline.py) or any row's own rate, whichever is higher, so no
row beats its floor; ``vs_floor`` is time / floor. A windowed row
reads a window whatever the context, so its time stays flat as the context grows.

Run on a GPU: python3 -m benchmarks.decode_window [--quick]   (writes benchmarks/results/decode_window.json)
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import print_table, write_result
from benchmarks.launches import per_call_us
from benchmarks.roofline import read_bandwidth_gbs
from graphserve.kernels.common import sm_count
from graphserve.kernels.decode_attention import counters_numel, decode_attention, workspace_numel

DT = torch.bfloat16
PAGE = 16
# query heads, kv heads, head_dim, window, sinks
MODELS = {"mistral-7b-v0.1": (32, 8, 128, 4096, False), "gpt-oss": (64, 8, 64, 128, True)}
COLS = ["model", "attention", "batch", "context", "us", "kv_mb", "floor_us", "vs_floor"]


def bench(model: str, windowed: bool, batch: int, ctx: int, layers: int, gbs: float) -> dict:
    hq, hkv, d, window, with_sinks = MODELS[model]
    window = window if windowed else None
    blocks = -(-ctx // PAGE)
    caches = [torch.randn(2, batch * blocks + 1, PAGE, hkv, d, device="cuda", dtype=DT) for _ in range(layers)]
    tables = (torch.randperm(batch * blocks, device="cuda").int() + 1).view(batch, blocks)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    sms = sm_count(tables.device)
    ws = torch.empty(workspace_numel(hq, hkv, d, sms), device="cuda")
    counters = torch.zeros(max(1, counters_numel(hkv, sms)), dtype=torch.int32, device="cuda")
    sinks = torch.randn(hq, device="cuda") if with_sinks else None
    qs = [torch.randn(batch, hq, d, device="cuda", dtype=DT) for _ in range(layers)]
    outs = [torch.empty_like(q) for q in qs]
    calls = [lambda q=q, c=c, o=o: decode_attention(q, c, tables, lens, d**-0.5, out=o, workspace=ws,
                                                    counters=counters, window=window, sinks=sinks)
             for q, c, o in zip(qs, caches, outs)]  # fmt: skip
    us = per_call_us(calls)
    read_tokens = batch * (ctx if window is None else min(ctx, window))
    kv_bytes = read_tokens * 2 * hkv * d * DT.itemsize + batch * hq * d * DT.itemsize * 2  # K/V, q and out
    floor_us = kv_bytes / (gbs * 1e3)
    row = {"model": model, "attention": f"window {window}" if window else "full", "batch": batch, "context": ctx,
           "us": us, "kv_mb": kv_bytes / 1e6, "floor_us": floor_us, "vs_floor": us / floor_us}  # fmt: skip
    print_table([row], COLS)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="batch 1 and 32 at 16k tokens only")
    p.add_argument("--layers", type=int, default=8, help="calls per graph, each on its own cache")
    args = p.parse_args()
    gbs = read_bandwidth_gbs()
    shapes = [(1, 16384), (32, 16384)] if args.quick else [(1, 8192), (1, 32768), (32, 16384), (128, 8192)]
    rows = []
    with torch.inference_mode():
        for model in MODELS:
            for batch, ctx in shapes:
                for windowed in (True, False):
                    rows.append(bench(model, windowed, batch, ctx, args.layers, gbs))
                    torch.cuda.empty_cache()
    best = max([gbs] + [r["kv_mb"] * 1e6 / (r["us"] * 1e3) for r in rows])  # GB/s
    for r in rows:
        r["floor_us"] = r["kv_mb"] * 1e6 / (best * 1e3)
        r["vs_floor"] = r["us"] / r["floor_us"]
    print()
    print(f"read bandwidth {best:.0f} GB/s (probes {gbs:.0f})")
    print_table(rows, COLS)
    write_result("decode_window", {"layers": args.layers, "probe_read_gbs": gbs, "read_gbs": best, "rows": rows})


if __name__ == "__main__":
    main()
