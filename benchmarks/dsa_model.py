"""DeepSeek sparse attention decode against its floor: dummy:glm-5-l5 whole steps.

One decode step replayed from its CUDA graph at each batch size, every sequence attending over ``ctx`` cached
tokens, routing uniform (``--routing router`` adds the random router's own choice), as benchmarks/deepseek.py
measures V2-Lite. Floor: the bytes the step must read (``ModelDescription.decode_read_bytes``): dense weights
(MLA and indexer projections, the dense layers, router gates, shared experts), the lm_head, the batch's
embedding rows, the routed experts touched, every indexer key of each context and, past ``index_topk``, only the
``index_topk`` latent rows each sequence's attention reads per layer; over the best read bandwidth measured in
the same run. ``--ctx`` above 2048 is where the selection drops positions.

Run: python3 -m benchmarks.dsa_model [--bs 1 64] [--ctx 4096] [--routing uniform router]   (dsa_decode.json)
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import print_table, write_result
from benchmarks.moe import bench_decode
from benchmarks.roofline import measured_read_bw

COLS = ["model", "bs", "ctx", "routing", "experts_touched", "step_ms", "floor_ms", "ratio", "ratio_datasheet"]
GLM5 = "dummy:glm-5-l5"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bs", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--routing", nargs="+", default=["uniform"], choices=["uniform", "router"])
    args = p.parse_args()
    start = time.perf_counter()
    bw = measured_read_bw()
    print(bw.describe())
    rows = bench_decode(GLM5, args.bs, args.ctx, args.routing, bw, loop_bs=[])
    for r in rows:
        r.update(bw.ratios(r["step_ms"], r["bytes"]))
    write_result("dsa_decode", {"read_bandwidth": bw.summary(), "rows": rows})
    print(f"GLM-5 (5 layers) decode: {time.perf_counter() - start:.0f} s\n")
    print_table(rows, COLS)


if __name__ == "__main__":
    main()
