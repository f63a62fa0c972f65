"""The attention prologue inside decode attention, or as its own launch: the same decode step captured both
ways, timed in turns.

Per model, context and batch size: one model load and KV cache, two CUDA-graph captures of the decode step
(layers/attention_triton.decode_prologue: ``fused=False``, the q/k norm, rotary and K/V write in
kernels/qk_rope_kv.py's launch before decode attention; ``fused=True``, the engine's default, all of it inside
the decode kernel, kernels/decode_attention.decode_attention_qkv), replayed alternately for ``--rounds`` rounds
(benchmarks/pdl.timed_captures), each side's time the median of its rounds. The floor is the bytes the step
must read over the best read bandwidth measured in this run (benchmarks/roofline.py). ``same_tokens``: whether
both captures' greedy tokens agree (the new token's score is summed in another order, so a near tie may not).

Run: python3 -m benchmarks.decode_prologue [--models dummy:llama3-8b] [--fp8-models dummy:llama3-8b
     dummy:qwen3-30b-a3b] [--bs 1 64] [--ctx 512 2048]
"""

from __future__ import annotations

import argparse

from benchmarks.common import print_table, write_result
from benchmarks.pdl import timed_captures
from benchmarks.roofline import measured_read_bw
from graphserve.layers.attention_triton import decode_prologue

COLS = ["model", "quantization", "bs", "ctx", "launch_ms", "in_decode_ms", "saved_us", "floor_ms", "ratio_launch",
        "ratio_in_decode", "same_tokens"]
VARIANTS = {"launch": False, "in decode": True}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["dummy:llama3-8b"], help="run in the checkpoint's dtype")
    p.add_argument("--fp8-models", nargs="*", default=["dummy:llama3-8b", "dummy:qwen3-30b-a3b"],
                   help="run with --quantization fp8")
    p.add_argument("--bs", nargs="+", type=int, default=[1, 64])
    p.add_argument("--ctx", nargs="+", type=int, default=[512])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--result-name", default="decode_prologue", help="benchmarks/results/NAME.json")
    args = p.parse_args()
    if args.rounds < 1 or min(args.ctx) < 1 or min(args.bs) < 1:
        p.error(f"--rounds {args.rounds}, --ctx {args.ctx} and --bs {args.bs} must all be >= 1")
    bw = measured_read_bw()
    print(bw.describe())
    scopes = {label: (lambda f=fused: decode_prologue(f)) for label, fused in VARIANTS.items()}
    rows = []
    for quantization, models in (("none", args.models), ("fp8", args.fp8_models)):
        for model in models:
            for ctx in args.ctx:
                rows += timed_captures(model, quantization, args.bs, ctx, args.rounds, bw, scopes)
    for r in rows:  # every row against the best rate of the whole run
        r["launch_ms"], r["in_decode_ms"] = r["variants_ms"]["launch"], r["variants_ms"]["in decode"]
        r["saved_us"] = (r["launch_ms"] - r["in_decode_ms"]) * 1e3
        r["floor_ms"] = bw.floor_ms(r["bytes"])
        r["ratio_launch"], r["ratio_in_decode"] = r["launch_ms"] / r["floor_ms"], r["in_decode_ms"] / r["floor_ms"]
    print_table(rows, COLS)
    write_result(args.result_name, {"read_bandwidth": bw.summary(), "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
