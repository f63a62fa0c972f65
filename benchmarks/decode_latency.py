"""The batch-1 latency-bound kernels of a MoE decode step, per layer, under CUDA graphs, with their knobs.

Each row is one configuration timed as a graph of ``--layers`` back-to-back calls on distinct
buffers (each layer its own KV cache, gate weights or experts, so the reads come from HBM as in a
real step, not from an L2 warmed by the previous layer):
- decode attention (Qwen3-30B-A3B's 32/4 heads and Llama-3-8B's 32/8, head_dim 128) at batch 1 and
  4, context 1024 in block tables sized for 1088 and 8192 tokens and context 4096, for each
  ``min_split_len`` (64 reproduces the one-step splits of the launch; 128 is the default);
- the MoE router gate + softmax top-k at one row of Qwen3-30B-A3B's router (128 x 2048, k 8), plain
  and with the add + RMSNorm, for gate rows per program and the top-k tail (ranks or argmax rounds);
- ``--only router-select``: the tensor-core gate + top-k at 16, 32 and 64 rows, and the standalone top-k, for
  each way of selecting the k largest (kernels/moe_routing.TOPK_SELECTS), at k 8 and k 1;
- the streaming experts (gate_up + down) at one token of Qwen3-30B-A3B (k 8 of 128 experts, random
  routing per layer) for a few gate_up tiles, with the table's down tile; ``gbps`` counts the
  routed experts' bytes.

Run on a GPU: python3 -m benchmarks.decode_latency [--quick]   (writes benchmarks/results/decode_latency.json)
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import print_table, write_result
from benchmarks.launches import per_call_us
from graphserve.kernels.common import sm_count
from graphserve.kernels.decode_attention import choose_num_splits, counters_numel, decode_attention, workspace_numel
from graphserve.kernels.moe_config import GemvTile, moe_tiles
from graphserve.kernels.moe_fused import fused_experts
from graphserve.kernels.moe_gate import moe_add_norm_gate_softmax_topk, moe_gate_softmax_topk
from graphserve.kernels.moe_gate_dot import GATE_COUNTERS, moe_gate_dot_softmax_topk
from graphserve.kernels.moe_routing import TOPK_SELECTS, moe_softmax_topk

DT = torch.bfloat16
PAGE = 16
ATTENTION = {"qwen3-30b-a3b": (32, 4, 128), "llama3-8b": (32, 8, 128)}  # query heads, kv heads, head_dim
ROUTER = (128, 2048, 8)  # Qwen3-30B-A3B: experts, hidden, top_k
EXPERTS = (128, 2048, 768, 8)  # Qwen3-30B-A3B: experts, hidden, intermediate, top_k
GATE_UP_TILES = [GemvTile(8, 256, 4), GemvTile(8, 128, 4), GemvTile(4, 256, 4), GemvTile(16, 128, 4)]
COLS = ["kernel", "shape", "knobs", "us"]


def bench_attention(model: str, batch: int, ctx: int, capacity: int, split_lens: list[int], layers: int) -> list[dict]:
    hq, hkv, d = ATTENTION[model]
    blocks, width = -(-ctx // PAGE), -(-capacity // PAGE) + 1
    caches = [torch.randn(2, batch * blocks + 1, PAGE, hkv, d, device="cuda", dtype=DT) for _ in range(layers)]
    tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    tables[:, :blocks] = (torch.randperm(batch * blocks, device="cuda").int() + 1).view(batch, blocks)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    sms = sm_count(tables.device)
    ws = torch.empty(workspace_numel(hq, hkv, d, sms), device="cuda")
    counters = torch.zeros(max(1, counters_numel(hkv, sms)), dtype=torch.int32, device="cuda")
    qs = [torch.randn(batch, hq, d, device="cuda", dtype=DT) for _ in range(layers)]
    outs = [torch.empty_like(q) for q in qs]
    splits = choose_num_splits(batch, hkv, width * PAGE, sms)
    rows = []
    for split_len in split_lens:
        calls = [lambda q=q, c=c, o=o, n=split_len: decode_attention(q, c, tables, lens, d**-0.5, out=o, workspace=ws,
                                                                     counters=counters, min_split_len=n)
                 for q, c, o in zip(qs, caches, outs)]  # fmt: skip
        rows.append(_row("decode_attention", f"{model} bs{batch} ctx{ctx} cap{capacity} splits{splits}",
                         f"min_split_len={split_len}", per_call_us(calls)))  # fmt: skip
    return rows


def bench_gate(block_eps: list[int], layers: int) -> list[dict]:
    e, h, k = ROUTER
    xs = [torch.randn(1, h, device="cuda", dtype=DT) for _ in range(layers)]
    residuals = [torch.randn(1, h, device="cuda", dtype=DT) for _ in range(layers)]
    norm_ws = [(1 + 0.1 * torch.randn(h, device="cuda")).to(DT) for _ in range(layers)]
    gates = [(torch.randn(e, h, device="cuda") * h**-0.5).to(DT) for _ in range(layers)]
    counters = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(layers)]
    layer_args = list(zip(xs, residuals, norm_ws, gates, counters))
    rows = []
    for norm in (False, True):
        for block_ep in block_eps:
            for rank in (True, False):
                if norm:
                    calls = [
                        lambda x=x, r=r, nw=nw, g=g, c=c, ep=block_ep, rk=rank: moe_add_norm_gate_softmax_topk(
                            x, r, nw, 1e-6, g, k, True, c, block_ep=ep, rank_topk=rk
                        )
                        for x, r, nw, g, c in layer_args
                    ]
                else:
                    calls = [
                        lambda x=x, g=g, c=c, ep=block_ep, rk=rank: moe_gate_softmax_topk(
                            x, g, k, True, c, block_ep=ep, rank_topk=rk
                        )
                        for x, _, _, g, c in layer_args
                    ]
                knobs = f"block_ep={block_ep} tail={'rank' if rank else 'argmax'}"
                rows.append(_row("moe_gate" + ("+add_norm" if norm else ""), f"T1 E{e} H{h} k{k}", knobs,
                                 per_call_us(calls)))  # fmt: skip
    return rows


def bench_router_select(rows_list: list[int], layers: int) -> list[dict]:
    """The tensor-core gate (kernels/moe_gate_dot.py) at decode batches of Qwen3-30B-A3B's router, and the
    standalone top-k on fp32 logits, for each of kernels/moe_routing.TOPK_SELECTS; top-1 too, where the
    selection is one round whatever it is (what the k rounds cost over it)."""
    e, h, k = ROUTER
    rows = []
    for t in rows_list:
        xs = [torch.randn(t, h, device="cuda", dtype=DT) for _ in range(layers)]
        gates = [(torch.randn(e, h, device="cuda") * h**-0.5).to(DT) for _ in range(layers)]
        logits = [torch.randn(t, e, device="cuda") for _ in range(layers)]
        counters = [torch.zeros(GATE_COUNTERS, dtype=torch.int32, device="cuda") for _ in range(layers)]
        for top_k in (1, k):
            for select in TOPK_SELECTS:
                calls = [lambda x=x, g=g, c=c, s=select, kk=top_k: moe_gate_dot_softmax_topk(x, g, kk, True, c, select=s)
                         for x, g, c in zip(xs, gates, counters)]  # fmt: skip
                rows.append(_row("moe_gate_dot", f"T{t} E{e} H{h} k{top_k}", f"select={select}", per_call_us(calls)))
                calls = [lambda lg=lg, s=select, kk=top_k: moe_softmax_topk(lg, kk, True, select=s) for lg in logits]
                rows.append(_row("moe_softmax_topk", f"T{t} E{e} k{top_k}", f"select={select}", per_call_us(calls)))
    return rows


def bench_experts(tiles: list[GemvTile], layers: int) -> list[dict]:
    e, h, inter, k = EXPERTS
    w13s = [torch.randn(e, 2 * inter, h, device="cuda", dtype=DT) * 0.02 for _ in range(layers)]
    w2s = [torch.randn(e, h, inter, device="cuda", dtype=DT) * 0.02 for _ in range(layers)]
    xs = [torch.randn(1, h, device="cuda", dtype=DT) for _ in range(layers)]
    ids = [torch.randperm(e, device="cuda")[:k].int().view(1, k) for _ in range(layers)]
    weights = torch.full((1, k), 1.0 / k, device="cuda")
    down = moe_tiles(e, inter, h, DT, xs[0].device).gemv_tiles(k, inter, h)[1]
    routed_bytes = k * 3 * inter * h * 2
    rows = []
    for tile in tiles:
        calls = [lambda x=x, a=a, b=b, i=i, t=tile: fused_experts(x, a, b, weights, i, path="gemv",
                                                                  gemv_tiles=(t, down))
                 for x, a, b, i in zip(xs, w13s, w2s, ids)]  # fmt: skip
        us = per_call_us(calls)
        row = _row("moe_gemv gate_up+down", f"T1 E{e} H{h} I{inter} k{k}", f"gate_up={_tile(tile)} down={_tile(down)}",
                   us)  # fmt: skip
        row["gbps"] = routed_bytes / us / 1e3
        rows.append(row)
    return rows


def _tile(t: GemvTile) -> str:
    return f"n{t.block_n}k{t.block_k}w{t.num_warps}s{t.num_stages}"


def _row(kernel: str, shape: str, knobs: str, us: float) -> dict:
    row = {"kernel": kernel, "shape": shape, "knobs": knobs, "us": us}
    print_table([row], COLS)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="batch 1 attention at 1024 tokens, fewer knobs")
    p.add_argument("--layers", type=int, default=48, help="calls per graph, each on its own buffers")
    p.add_argument("--only", choices=["router-select"], help="one section: the router's top-k selections at "
                   "decode batches (writes decode_latency_router_select.json)")  # fmt: skip
    args = p.parse_args()
    if args.only == "router-select":
        with torch.inference_mode():
            rows = bench_router_select([16, 32, 64], args.layers)
        write_result("decode_latency_router_select", {"layers": args.layers, "rows": rows})
        return
    split_lens = [64, 128] if args.quick else [64, 128, 256]
    attention = [(1, 1024, 1088), (1, 1024, 8192)] + ([] if args.quick else [(4, 1024, 1088), (1, 4096, 8192)])
    rows = []
    with torch.inference_mode():
        for model in ATTENTION:
            for batch, ctx, cap in attention:
                rows += bench_attention(model, batch, ctx, cap, split_lens, args.layers)
        torch.cuda.empty_cache()
        rows += bench_gate([1, 2] if args.quick else [1, 2, 4], args.layers)
        # experts: 1.2 GB of bf16 weights per layer, so a few layers, each routed to 8 experts of its own
        rows += bench_experts(GATE_UP_TILES[:2] if args.quick else GATE_UP_TILES, min(args.layers, 6))
    print()
    print_table(rows, COLS + ["gbps"])
    write_result("decode_latency", {"layers": args.layers, "rows": rows})


if __name__ == "__main__":
    main()
