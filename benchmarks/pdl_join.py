"""The output projection after decode attention launched with PDL, or not: the same decode step captured both
ways, timed in turns.

Where decode attention's grid runs in one wave with room beside it (a decode step at small batch), the output
projection that follows it launches with PDL although its kernel (the FP8 streaming matmul) is left out by
default: its programs are placed while attention runs and wait there (kernels/pdl.pdl_joined,
models/llama.AFTER_DECODE_ATTENTION, layers/attention_triton.leaves_room). ``pdl_joins`` turns it off for the
comparison. At larger batches attention fills the GPU and the two captures are the same step.

Per model, context and batch size: one model load and KV cache, two CUDA-graph captures of the decode step,
replayed alternately for ``--rounds`` rounds (benchmarks/pdl.timed_captures), each one's time the median of its
rounds. The floor is the bytes the step must read over the best read bandwidth measured in this run
(benchmarks/roofline.py). ``same_tokens``: whether every capture's greedy tokens agree.

Run: python3 -m benchmarks.pdl_join [--fp8-models dummy:llama3-8b dummy:qwen3-30b-a3b] [--bs 1 8 64] [--ctx 512]
"""

from __future__ import annotations

import argparse

from benchmarks.common import print_table, write_result
from benchmarks.pdl import timed_captures
from benchmarks.roofline import measured_read_bw
from graphserve.kernels.pdl import pdl_joins

COLS = ["model", "quantization", "bs", "ctx", "apart_ms", "joined_ms", "floor_ms", "ratio_apart", "ratio_joined",
        "joined_vs_apart", "same_tokens"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=[], help="run in the checkpoint's dtype")
    p.add_argument("--fp8-models", nargs="*", default=["dummy:llama3-8b", "dummy:qwen3-30b-a3b"],
                   help="run with --quantization fp8")
    p.add_argument("--bs", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--ctx", nargs="+", type=int, default=[512])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--result-name", default="pdl_join", help="benchmarks/results/NAME.json")
    args = p.parse_args()
    if args.rounds < 1 or min(args.ctx) < 1 or min(args.bs) < 1:
        p.error(f"--rounds {args.rounds}, --ctx {args.ctx} and --bs {args.bs} must all be >= 1")
    bw = measured_read_bw()
    print(bw.describe())
    scopes = {"apart": lambda: pdl_joins(False), "joined": lambda: pdl_joins(True)}
    rows = []
    for quantization, models in (("none", args.models), ("fp8", args.fp8_models)):
        for model in models:
            for ctx in args.ctx:
                rows += timed_captures(model, quantization, args.bs, ctx, args.rounds, bw, scopes)
    for r in rows:  # every row against the best rate of the whole run
        r["apart_ms"], r["joined_ms"] = r["variants_ms"]["apart"], r["variants_ms"]["joined"]
        r["floor_ms"] = bw.floor_ms(r["bytes"])
        r["ratio_apart"], r["ratio_joined"] = r["apart_ms"] / r["floor_ms"], r["joined_ms"] / r["floor_ms"]
        r["joined_vs_apart"] = r["joined_ms"] / r["apart_ms"]
    print_table(rows, COLS)
    write_result(args.result_name, {"read_bandwidth": bw.summary(), "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
