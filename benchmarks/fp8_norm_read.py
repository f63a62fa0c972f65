"""The FP8 streaming matmul with a norm in its loads reading x once or twice: the kernel alone at Llama-3-8B's
normed projections, and the decode step captured both ways.

Where one tile holds all of K (the qkv and gate_up projections at batch 1), ``WHOLE_X`` reads the rows of x
(and the residual) once, keeps their sum in registers for the product, instead of one pass for the norm's
statistics and a second for the product (kernels/fp8_gemv.py). At batch 1 every program reads the whole row
again from L2: with 8-row tiles, Llama-3-8B's gate_up reads about as many bytes of x from L2 as of its weight
from memory. ``one_read_norm`` turns it off for the comparison.

Kernels alone: each projection (per-channel FP8 as ``--quantization fp8`` makes it) for one row, with the
routing table's tile and a few others, in a CUDA graph of back-to-back calls over cold weight copies, both ways
in turns, the median of ``--rounds`` rounds; the floor is its bytes over the best read rate measured in this run.
Steps: per model, context and batch size, one model load and two captures of the decode step replayed in turns
(benchmarks/pdl.compare_captures); ``same_tokens``: whether both captures' greedy tokens agree.

Run: python3 -m benchmarks.fp8_norm_read [--fp8-models dummy:llama3-8b dummy:qwen3-30b-a3b] [--bs 1 8] [--ctx 512]
"""

from __future__ import annotations

import itertools
import math
import statistics

import torch

from benchmarks.common import print_table, write_result
from benchmarks.pdl import compare_captures
from graphserve.kernels.fp8_gemv import one_read_norm

COLS = ["model", "quantization", "bs", "ctx", "two_ms", "one_ms", "floor_ms", "ratio_two", "ratio_one", "one_vs_two",
        "same_tokens"]
KERNEL_COLS = ["shape", "tile", "two_us", "one_us", "floor_us", "ratio_two", "ratio_one", "one_vs_two"]
# other one-row tiles holding all of K: (block_n, warps, stages)
TILES = [(4, 2, 2), (16, 4, 2), (16, 8, 2), (32, 8, 2)]
HIDDEN = 4096
SHAPES = {"llama3-8b qkv": 6144, "llama3-8b gate_up": 28672}
COLD_BYTES = 512 << 20


def kernels_alone(bw, rounds: int) -> list[dict]:
    from benchmarks.kernels import graph_time_ms
    from graphserve.kernels.fp8_config import StreamConfig, rule_for
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
        table = rule.route(1, n, HIDDEN, "channel").config
        tiles = {f"table {table.block_n}x{table.block_k} w{table.num_warps} s{table.num_stages}": table}
        for bn, warps, stages in TILES:
            tiles[f"{bn}x{HIDDEN} w{warps} s{stages}"] = StreamConfig(bn, HIDDEN, warps, stages, use_dot=False)
        step = itertools.count()
        for tile, cfg in tiles.items():

            def call(cfg=cfg, weights=weights, copies=copies, step=step):
                w, s = weights[next(step) % copies]
                fp8_norm_gemv(x, norm_w, 1e-5, w, s.view(-1, 1), 1, HIDDEN, residual=residual, config=cfg)

            times = {"two": [], "one": []}
            for _ in range(rounds):
                for label in times:
                    with one_read_norm(label == "one"):  # the scope holds at capture, inside graph_time_ms
                        times[label].append(graph_time_ms(call, calls=2 * copies) * 1e3)
            med = {label: statistics.median(t) for label, t in times.items()}
            floor = bw.floor_ms(n * HIDDEN + 4 * n) * 1e3
            rows.append({"shape": shape, "tile": tile, "two_us": med["two"], "one_us": med["one"], "floor_us": floor,
                         "ratio_two": med["two"] / floor, "ratio_one": med["one"] / floor,
                         "one_vs_two": med["one"] / med["two"], "rounds_us": times})  # fmt: skip
        del weights
    return rows


def main() -> None:
    scopes = {"two": lambda: one_read_norm(False), "one": lambda: one_read_norm(True)}
    args, rows, finish = compare_captures(__doc__, scopes, result_name="fp8_norm_read", models=[],
                                          fp8_models=["dummy:llama3-8b", "dummy:qwen3-30b-a3b"], bs=[1, 8])  # fmt: skip
    for r in rows:
        r["two_ms"], r["one_ms"] = r["variants_ms"]["two"], r["variants_ms"]["one"]
        r["ratio_two"], r["ratio_one"] = r["two_ms"] / r["floor_ms"], r["one_ms"] / r["floor_ms"]
        r["one_vs_two"] = r["one_ms"] / r["two_ms"]
    kernel_rows = kernels_alone(args.bw, args.rounds)
    print_table(kernel_rows, KERNEL_COLS)
    write_result(f"{args.result_name}_kernels", {"read_bandwidth": args.bw.summary(), "rows": kernel_rows})
    finish(COLS)


if __name__ == "__main__":
    main()
