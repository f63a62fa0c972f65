"""The FP8 streaming matmul behind a norm with its weight tile requested before the norm's reads, or after: the
kernel alone at Llama-3-8B's normed projections, and the decode step captured both ways.

Where a launch's every split is one weight tile and a norm (residual add + RMSNorm) is computed in its loads
(the qkv and gate_up projections at batch 1), ``EARLY_W`` issues the tile's load first, so its DRAM latency
overlaps the norm's reads of x and its reduction (kernels/fp8_gemv.py). ``early_weights`` turns it off for the
comparison.

Kernels alone: each projection (per-channel FP8 as ``--quantization fp8`` makes it, the routing table's tile for
one row) in a CUDA graph of back-to-back calls over cold weight copies, both ways in turns, the median of
``--rounds`` rounds; the floor is its bytes over the best read rate measured in this run. Steps: per model,
context and batch size, one model load and two captures of the decode step replayed in turns
(benchmarks/pdl.compare_captures); ``same_tokens``: whether both captures' greedy tokens agree.

Run: python3 -m benchmarks.fp8_early [--fp8-models dummy:llama3-8b dummy:qwen3-30b-a3b] [--bs 1 8] [--ctx 512]
"""

from __future__ import annotations

import itertools
import math
import statistics

import torch

from benchmarks.common import print_table, write_result
from benchmarks.pdl import compare_captures
from graphserve.kernels.fp8_gemv import early_weights

COLS = ["model", "quantization", "bs", "ctx", "after_ms", "early_ms", "floor_ms", "ratio_after", "ratio_early",
        "early_vs_after", "same_tokens"]
KERNEL_COLS = ["shape", "tile", "after_us", "early_us", "floor_us", "ratio_after", "ratio_early", "early_vs_after"]
HIDDEN = 4096
SHAPES = {"llama3-8b qkv": 6144, "llama3-8b gate_up": 28672}
COLD_BYTES = 512 << 20


def kernels_alone(bw, rounds: int) -> list[dict]:
    from benchmarks.kernels import graph_time_ms
    from graphserve.kernels.fp8_config import rule_for
    from graphserve.kernels.fp8_gemv import fp8_norm_gemv
    from graphserve.kernels.fp8_quant import quantize_weight_channels

    dev = torch.device("cuda")
    x = torch.randn(1, HIDDEN, device=dev).to(torch.bfloat16)
    residual = torch.randn(1, HIDDEN, device=dev).to(torch.bfloat16)
    norm_w = torch.rand(HIDDEN, device=dev).to(torch.bfloat16) + 0.5
    rule = rule_for(dev)
    rows = []
    for shape, n in SHAPES.items():
        copies = max(2, math.ceil(COLD_BYTES / (n * HIDDEN)))
        weights = [quantize_weight_channels(torch.randn(n, HIDDEN, device=dev) * 0.02) for _ in range(copies)]
        cfg = getattr(rule.route(1, n, HIDDEN, "channel"), "config", None)
        step = itertools.count()

        def call(cfg=cfg, weights=weights, copies=copies, step=step):
            w, s = weights[next(step) % copies]
            fp8_norm_gemv(x, norm_w, 1e-5, w, s.view(-1, 1), 1, HIDDEN, residual=residual, config=cfg)

        times = {"after": [], "early": []}
        for _ in range(rounds):
            for label in times:
                with early_weights(label == "early"):  # the scope holds at capture, inside graph_time_ms
                    times[label].append(graph_time_ms(call, calls=2 * copies) * 1e3)
        med = {label: statistics.median(t) for label, t in times.items()}
        floor = bw.floor_ms(n * HIDDEN + 4 * n) * 1e3
        rows.append({"shape": shape, "tile": str(cfg), "after_us": med["after"], "early_us": med["early"],
                     "floor_us": floor, "ratio_after": med["after"] / floor, "ratio_early": med["early"] / floor,
                     "early_vs_after": med["early"] / med["after"], "rounds_us": times})
        del weights
    return rows


def main() -> None:
    scopes = {"after": lambda: early_weights(False), "early": lambda: early_weights(True)}
    args, rows, finish = compare_captures(__doc__, scopes, result_name="fp8_early", models=[],
                                          fp8_models=["dummy:llama3-8b", "dummy:qwen3-30b-a3b"], bs=[1, 8])  # fmt: skip
    for r in rows:
        r["after_ms"], r["early_ms"] = r["variants_ms"]["after"], r["variants_ms"]["early"]
        r["ratio_after"], r["ratio_early"] = r["after_ms"] / r["floor_ms"], r["early_ms"] / r["floor_ms"]
        r["early_vs_after"] = r["early_ms"] / r["after_ms"]
    kernel_rows = kernels_alone(args.bw, args.rounds)
    print_table(kernel_rows, KERNEL_COLS)
    write_result(f"{args.result_name}_kernels", {"read_bandwidth": args.bw.summary(), "rows": kernel_rows})
    finish(COLS)


if __name__ == "__main__":
    main()
