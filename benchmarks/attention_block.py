"""Where a batch-1 FP8 decode layer's attention block spends its time: the qkv projection (the residual add and
RMSNorm in its loads), decode attention (the prologue inside it) and the output projection, each alone and in
chains, over cold weight copies, against the floor of the same run.

Llama-3-8B's shapes (32 q heads, 8 kv heads of 128, hidden 4096, per-channel FP8 weights as ``--quantization
fp8`` makes them), a context of ``--ctx`` tokens in pages of 16. Every variant is a CUDA graph of back-to-back
calls, each on the next of ``layers`` copies (its own weights and KV cache, together past the L2), so a weight
is never read warm; its time is one call's (one layer's) share, the median over ``--rounds`` rounds taken in turns.
The floor divides the bytes a variant must read (the weights and their scales, the context's K and V) by the best
read bandwidth measured in this run (benchmarks/roofline.py); ``gap_us`` is a chain's time less the sum of its
pieces alone. Variants also run the projections with other streaming tiles than the routing table's, and the
chain with the output projection launched with PDL (kernels/pdl.pdl_joined) or not. Reads of the projections'
byte counts by cuBLAS's bf16 matvec (the read probe's best method) over cold buffers of those sizes say what a
library's one launch of that size reaches, where the floor's bandwidth is a long stream's.

Run: python3 -m benchmarks.attention_block [--ctx 512] [--rounds 5]   (writes benchmarks/results/attention_block.json)
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics

import torch

from benchmarks.common import print_table, write_result

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, PAGE = 4096, 32, 8, 128, 16
COLD_BYTES = 512 << 20
# other tiles for the two projections: (block_n, block_k, warps, stages, split_k)
QKV_TILES = [(16, 2048, 4, 2, 1), (4, 4096, 2, 2, 1), (8, 2048, 4, 3, 1), (8, 2048, 4, 2, 1), (8, 1024, 4, 2, 1)]
O_TILES = [(4, 4096, 4, 2, 1), (16, 1024, 4, 2, 1), (8, 1024, 4, 3, 1), (8, 2048, 4, 2, 2), (16, 4096, 8, 2, 1)]


def main() -> None:
    from benchmarks.kernels import graph_time_ms
    from benchmarks.roofline import measured_read_bw
    from graphserve.kernels.decode_attention import NewToken, decode_attention_qkv
    from graphserve.kernels.fp8_config import StreamConfig, rule_for
    from graphserve.kernels.fp8_gemv import fp8_gemv, fp8_norm_gemv
    from graphserve.kernels.fp8_quant import quantize_weight_channels
    from graphserve.kernels.pdl import pdl_joined, pdl_joins
    from graphserve.kernels.rotary import rotary_cos_sin
    from graphserve.layers.attention_triton import TritonAttentionBackend

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.ctx < 2 or args.rounds < 1:
        p.error(f"--ctx {args.ctx} must be >= 2 and --rounds {args.rounds} >= 1")
    bw = measured_read_bw()
    print(f"probes: {bw.describe()}")
    dev = torch.device("cuda")
    qkv_n = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    blocks = math.ceil(args.ctx / PAGE)
    kv_bytes = 2 * args.ctx * KV_HEADS * HEAD_DIM * 2
    per_layer = qkv_n * HIDDEN + HIDDEN * HIDDEN + kv_bytes
    copies = max(2, math.ceil(COLD_BYTES / per_layer))
    layers = []
    for _ in range(copies):
        wq, sq = quantize_weight_channels(torch.randn(qkv_n, HIDDEN, device=dev) * 0.02)
        wo, so = quantize_weight_channels(torch.randn(HIDDEN, HIDDEN, device=dev) * 0.02)
        cache = torch.randn(2, blocks, PAGE, KV_HEADS, HEAD_DIM, device=dev).to(torch.bfloat16)
        qkv = torch.randn(1, qkv_n, device=dev).to(torch.bfloat16)
        attn = torch.randn(1, HIDDEN, device=dev).to(torch.bfloat16)
        layers.append({"wq": wq, "sq": sq.view(-1, 1), "wo": wo, "so": so.view(-1, 1), "cache": cache, "qkv": qkv,
                       "attn": attn})
    x = torch.randn(1, HIDDEN, device=dev).to(torch.bfloat16)
    residual = torch.randn(1, HIDDEN, device=dev).to(torch.bfloat16)
    norm_w = torch.rand(HIDDEN, device=dev).to(torch.bfloat16) + 0.5
    tables = torch.arange(blocks, device=dev, dtype=torch.int32)[None, :]
    lens = torch.tensor([args.ctx], device=dev, dtype=torch.int32)
    positions = lens.long() - 1
    slots = positions.clone()
    cos, sin = rotary_cos_sin(args.ctx + 1, HEAD_DIM, base=500000.0, device=dev)
    ws, counters = TritonAttentionBackend().reserve(HEADS, KV_HEADS, HEAD_DIM, dev)
    out = torch.empty(1, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    rule = rule_for(dev)
    table_qkv, table_o = (getattr(rule.route(1, n, HIDDEN, "channel"), "config", None) for n in (qkv_n, HIDDEN))
    step = itertools.count()

    def tile(t):
        return StreamConfig(t[0], t[1], t[2], t[3], use_dot=False, split_k=t[4])

    def qkv_of(layer, cfg):
        return fp8_norm_gemv(x, norm_w, 1e-5, layer["wq"], layer["sq"], 1, HIDDEN, residual=residual, config=cfg)[0]

    def attention(layer, qkv):
        new = NewToken(qkv, HEADS, positions, cos, sin, slots)
        return decode_attention_qkv(new, layer["cache"], tables, lens, HEAD_DIM**-0.5, workspace=ws,
                                    counters=counters, out=out)  # fmt: skip

    def o_of(layer, a, cfg):
        return fp8_gemv(a.reshape(1, HIDDEN), layer["wo"], layer["so"], 1, HIDDEN, config=cfg)

    def variant(pieces: str, cfg_q=None, cfg_o=None):
        cfg_q, cfg_o = cfg_q or table_qkv, cfg_o or table_o

        def fn():
            layer = layers[next(step) % copies]
            qkv = qkv_of(layer, cfg_q) if "q" in pieces else layer["qkv"]
            a = attention(layer, qkv) if "a" in pieces else layer["attn"]
            if "o" in pieces:
                with pdl_joined({"_fp8_gemv_kernel"}):
                    o_of(layer, a, cfg_o)
        return fn

    nbytes = {"q": qkv_n * HIDDEN + 4 * qkv_n, "a": kv_bytes, "o": HIDDEN * HIDDEN + 4 * HIDDEN}
    # name: (pieces, qkv tile, o_proj tile, the output projection joins PDL)
    variants = {"qkv": ("q", None, None, False), "attention": ("a", None, None, False),
                "o_proj": ("o", None, None, False), "qkv+attention": ("qa", None, None, False),
                "attention+o_proj": ("ao", None, None, False), "attention+o_proj, join": ("ao", None, None, True),
                "block": ("qao", None, None, False), "block, join": ("qao", None, None, True)}  # fmt: skip
    for t in QKV_TILES:
        variants[f"qkv {t}"] = ("q", tile(t), None, False)
    for t in O_TILES:
        variants[f"o_proj {t}"] = ("o", None, tile(t), False)
        variants[f"attention+o_proj {t}"] = ("ao", None, tile(t), False)
    fns = {name: variant(pieces, cq, co) for name, (pieces, cq, co, _) in variants.items()}
    # the projections' byte counts read by cuBLAS's bf16 matvec over cold buffers of those sizes
    for piece, n in (("q", qkv_n), ("o", HIDDEN)):
        bufs = [torch.randn(n // 2, HIDDEN, device=dev).to(torch.bfloat16) for _ in range(copies)]
        name = f"read {nbytes[piece] >> 20} MiB ({'qkv' if piece == 'q' else 'o_proj'}'s bytes)"
        variants[name] = (piece, None, None, False)
        fns[name] = lambda b=bufs: torch.nn.functional.linear(x, b[next(step) % copies])
    calls = 2 * copies
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (_, _, _, join) in variants.items():
            with pdl_joins(join):  # the scope holds at capture, inside graph_time_ms
                times[name].append(graph_time_ms(fns[name], calls=calls) * 1e3)
    rows = []
    alone = {}
    for name, (pieces, *_) in variants.items():
        us = statistics.median(times[name])
        floor = bw.floor_ms(sum(nbytes[c] for c in pieces)) * 1e3
        if name in ("qkv", "attention", "o_proj"):
            alone[pieces] = us
        rows.append({"variant": name, "pieces": pieces, "us": us, "floor_us": floor, "ratio": us / floor,
                     "rounds_us": times[name]})
    for r in rows:
        if len(r["pieces"]) > 1 and all(c in alone for c in r["pieces"]):
            r["gap_us"] = r["us"] - sum(alone[c] for c in r["pieces"])
    print_table(rows, ["variant", "us", "floor_us", "ratio", "gap_us"])
    write_result("attention_block", {"read": bw.summary(), "ctx": args.ctx, "layers": copies,
                                     "table_tiles": {"qkv": str(table_qkv), "o_proj": str(table_o)}, "rows": rows})


if __name__ == "__main__":
    main()
