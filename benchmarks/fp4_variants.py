"""The FP4 streaming kernels' widenings side by side in one GPU run: kernels/fp4_words.py's widenings against the byte widening (kernels/fp4_layout.WIDENINGS), at Llama-3-8B's
projections at 1 and 8 rows (FMA and dot paths) in both formats beside the FP8 stream on the same shape, and the
routed experts' streaming path at 1 token (gpt-oss-120b's MXFP4, Qwen3-30B-A3B's NVFP4), each call routed to its own
random experts so that the experts read pass L2. Timing as benchmarks/fp4.py's (graph replays over weight copies
past L2); each row carries its relative difference from the default widening's output on the same input. Written
to benchmarks/results/fp4_variants.json; the default (fp4_layout.DEFAULT_WIDEN) changes only from these numbers.

Run: python3 -m benchmarks.fp4_variants
"""

from __future__ import annotations

from functools import partial

import torch

from benchmarks.common import print_table, write_result
from benchmarks.fp4 import (
    DT,
    ERRORS,
    LLAMA3_8B,
    MOE,
    _row,
    copies_for,
    fp4_bytes,
    fp4_expert_weights,
    fp4_weights,
    graph_ms,
)
from benchmarks.roofline import measured_read_bw
from graphserve.kernels.common import sm_count
from graphserve.kernels.fp4_gemv import fp4_gemv, stream_config
from graphserve.kernels.fp4_layout import GROUP, WIDENINGS
from graphserve.kernels.fp4_moe import fp4_fused_experts
from graphserve.kernels.fp8_gemv import fp8_gemv
from graphserve.kernels.fp8_quant import quantize_weight_blocks


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def variant_rows(card: str) -> list[dict]:
    """Each widening of the streaming matmul at Llama-3-8B's projections, 1 and 8 rows, beside the FP8 stream."""
    rows, sms = [], sm_count(torch.device("cuda"))
    for proj, (n, k) in LLAMA3_8B.items():
        wb = torch.randn(n, k, device="cuda", dtype=DT) * 0.02
        q8, s8 = quantize_weight_blocks(wb, 128, 128)
        fp8_block = [(q8.clone(), s8.clone()) for _ in range(copies_for(n * k))]
        del wb
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=DT)
            shape = {"card": card, "proj": proj, "n": n, "k": k, "m": m}
            ms = graph_ms([partial(fp8_gemv, x, w, s, 128, 128) for w, s in fp8_block])
            rows.append({**_row(shape, "fp8 stream", "fp8", ms, n * k + s8.numel() * 4), "widen": None})
        del fp8_block
        for fmt in ("nvfp4", "mxfp4"):
            ws = fp4_weights(n, k, fmt, copies_for(fp4_bytes(n, k, fmt)))
            for m in (1, 8):
                x = torch.randn(m, k, device="cuda", dtype=DT)
                shape = {"card": card, "proj": proj, "n": n, "k": k, "m": m}
                base = fp4_gemv(x, *ws[0], fmt)  # the default tiles and widening
                for widen in WIDENINGS:
                    cfg = stream_config(m, n, k, GROUP[fmt], sms, widen=widen)
                    try:
                        diff = _rel(fp4_gemv(x, *ws[0], fmt, config=cfg), base)
                    except Exception as e:  # a widening that does not build here costs its rows, not the run
                        ERRORS.append(f"fp4_gemv widen={widen} {proj} m={m} {fmt}: {type(e).__name__}: {str(e)[:300]}")
                        print(ERRORS[-1], flush=True)
                        diff = None
                    ms = graph_ms([partial(fp4_gemv, x, p, s, g, fmt, config=cfg) for p, s, g in ws])
                    rows.append({**_row(shape, f"fp4 stream {widen}", fmt, ms, fp4_bytes(n, k, fmt)), "widen": widen,
                                 "block_n": cfg.block_n, "block_k": cfg.block_k, "split_k": cfg.split_k,
                                 "use_dot": cfg.use_dot, "rel_diff_vs_default": diff})
            print(f"variants {proj} {fmt} done", flush=True)
            del ws
        torch.cuda.empty_cache()
    return rows


def moe_variant_rows(card: str, calls: int = 8) -> list[dict]:
    """The experts' streaming path at 1 token in each widening; ``calls`` calls a graph, each routed to its own
    random experts (gpt-oss-120b: 8 x 4 experts, ~420 MB, past L2)."""
    rows = []
    for name, (e, h, inter, topk, fmt, act) in MOE.items():
        w13p, w13s, g13, w2p, w2s, g2 = fp4_expert_weights(e, h, inter, fmt)
        x = torch.randn(1, h, device="cuda", dtype=DT)
        routes = [torch.softmax(torch.randn(1, e, device="cuda"), -1).topk(topk, dim=-1) for _ in range(calls)]
        routes = [(wts, ids.int()) for wts, ids in routes]
        experts = sum(ids.unique().numel() for _, ids in routes) / calls
        wbytes = experts * (fp4_bytes(2 * inter, h, fmt) + fp4_bytes(h, inter, fmt))
        args = (x, w13p, w13s, g13, w2p, w2s, g2, fmt)
        base = fp4_fused_experts(*args, *routes[0], activation=act, path="stream")
        for widen in WIDENINGS:
            try:
                diff = _rel(fp4_fused_experts(*args, *routes[0], activation=act, path="stream", widen=widen), base)
            except Exception as e:
                ERRORS.append(f"fp4_fused_experts widen={widen} {name}: {type(e).__name__}: {str(e)[:300]}")
                print(ERRORS[-1], flush=True)
                diff = None
            ms = graph_ms([partial(fp4_fused_experts, *args, wts, ids, activation=act, path="stream", widen=widen)
                           for wts, ids in routes])  # fmt: skip
            rows.append({"card": card, "model": name, "fmt": fmt, "tokens": 1, "experts_read": experts,
                         "path": "stream", "widen": widen, "ms": ms, "bytes": wbytes, "gbs": wbytes / ms / 1e6,
                         "rel_diff_vs_default": diff})
        del w13p, w13s, w2p, w2s
        torch.cuda.empty_cache()
    return rows


def run_variants(card: str) -> None:
    bw = measured_read_bw()
    rows, moe = variant_rows(card), moe_variant_rows(card)
    bw.probe_again()
    for r in rows + moe:
        r["ratio"] = r["ms"] / bw.floor_ms(r["bytes"])
    write_result("fp4_variants", {"read_bw": bw.summary(), "card": card, "widenings": list(WIDENINGS), "rows": rows,
                                  "moe": moe, "errors": ERRORS})
    print_table(rows, ["proj", "m", "fmt", "kernel", "ms", "gbs", "ratio", "rel_diff_vs_default"])
    print_table(moe, ["model", "tokens", "widen", "experts_read", "ms", "gbs", "ratio", "rel_diff_vs_default"])
    print(f"{card}; read bw {bw.best_gbs:.0f} GB/s ({bw.best_method})")


if __name__ == "__main__":
    run_variants(torch.cuda.get_device_name(0))
