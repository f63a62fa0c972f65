"""Two overlaps at decode attention's edges, on and off: the same decode step captured four ways, timed in turns.

- ``early KV``: decode attention with the prologue inside it asks for its split's first K and V tiles before its
  PDL wait, so their latency overlaps the qkv projection's tail (kernels/decode_attention.early_kv);
- ``join``: the output projection after decode attention launches with PDL although the FP8 streaming matmul is
  left out of it by default, its programs waiting on the SMs attention leaves idle (kernels/pdl.pdl_joined,
  models/llama.AFTER_DECODE_ATTENTION).

Per model, context and batch size: one model load and KV cache, one CUDA-graph capture of the decode step per
variant, replayed alternately for ``--rounds`` rounds (benchmarks/pdl.timed_captures), each one's time the median
of its rounds. The floor is the bytes the step must read over the best read bandwidth measured in this run
(benchmarks/roofline.py). ``same_tokens``: whether every capture's greedy tokens agree.

Run: python3 -m benchmarks.decode_overlap [--models] [--fp8-models dummy:llama3-8b dummy:qwen3-30b-a3b]
     [--bs 1 64] [--ctx 512]
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from benchmarks.common import print_table, write_result
from benchmarks.pdl import timed_captures
from benchmarks.roofline import measured_read_bw
from graphserve.kernels.decode_attention import early_kv
from graphserve.kernels.pdl import pdl_joins

# label: (early K/V loads, the output projection joins PDL)
VARIANTS = {"neither": (False, False), "early kv": (True, False), "join": (False, True), "both": (True, True)}
KEYS = {label: label.replace(" ", "_") + "_ms" for label in VARIANTS}  # "early kv" -> early_kv_ms
COLS = ["model", "quantization", "bs", "ctx", *KEYS.values(), "floor_ms", "ratio_neither", "ratio_best", "best",
        "same_tokens"]


@contextlib.contextmanager
def variant(early: bool, join: bool) -> Iterator[None]:
    with early_kv(early), pdl_joins(join):
        yield


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=[], help="run in the checkpoint's dtype")
    p.add_argument("--fp8-models", nargs="*", default=["dummy:llama3-8b", "dummy:qwen3-30b-a3b"],
                   help="run with --quantization fp8")
    p.add_argument("--bs", nargs="+", type=int, default=[1, 64])
    p.add_argument("--ctx", nargs="+", type=int, default=[512])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--result-name", default="decode_overlap", help="benchmarks/results/NAME.json")
    args = p.parse_args()
    if args.rounds < 1 or min(args.ctx) < 1 or min(args.bs) < 1:
        p.error(f"--rounds {args.rounds}, --ctx {args.ctx} and --bs {args.bs} must all be >= 1")
    bw = measured_read_bw()
    print(bw.describe())
    scopes = {label: (lambda e=early, j=join: variant(e, j)) for label, (early, join) in VARIANTS.items()}
    rows = []
    for quantization, models in (("none", args.models), ("fp8", args.fp8_models)):
        for model in models:
            for ctx in args.ctx:
                rows += timed_captures(model, quantization, args.bs, ctx, args.rounds, bw, scopes)
    for r in rows:  # every row against the best rate of the whole run
        r.update({KEYS[label]: ms for label, ms in r["variants_ms"].items()})
        r["best"] = min(r["variants_ms"], key=r["variants_ms"].get)
        r["floor_ms"] = bw.floor_ms(r["bytes"])
        r["ratio_neither"] = r["neither_ms"] / r["floor_ms"]
        r["ratio_best"] = r["variants_ms"][r["best"]] / r["floor_ms"]
    print_table(rows, COLS)
    write_result(args.result_name, {"read_bandwidth": bw.summary(), "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
