"""Decode-sized matmuls: the gemv kernels against cuBLAS (F.linear) at real projection shapes.

Each time is one call's share of a CUDA graph holding back-to-back calls, as decode runs them.
The calls cycle through enough copies of the weight (>= 256 MB in all) that every call reads
its weight from device memory, not from L2, as in a real step where the layers' weights
together dwarf the cache. Floor: bytes moved / read bandwidth measured in this run. The last
line is the largest batch at which gemv beats cuBLAS on every shape: the value for
``graphserve.layers.linear.GEMV_MAX_M``.

Run on a GPU: python3 -m benchmarks.gemv [--sweep]   (writes benchmarks/results/gemv.json)
``--sweep`` also times a grid of tile configurations per shape and batch and prints the best one
next to ``choose_config``'s pick, the data for retuning that function.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F

from benchmarks.common import print_table, write_result
from benchmarks.kernels import graph_time_ms
from benchmarks.roofline import measured_read_bw
from graphserve.kernels.activation import silu_and_mul
from graphserve.kernels.common import sm_count
from graphserve.kernels.gemv import gemv, silu_mul_gemv
from graphserve.kernels.gemv_config import GemvConfig, choose_config

DT = torch.bfloat16
BATCHES = [1, 2, 4, 8, 16]
COLD_BYTES = 256 << 20  # several times any GPU's L2
# name: (N, K); qkv and gate_up are the fused projections the models run
SHAPES = {
    "qwen3-0.6b qkv": (4096, 1024),
    "qwen3-0.6b o_proj": (1024, 2048),
    "qwen3-0.6b gate_up": (6144, 1024),
    "qwen3-0.6b down": (1024, 3072),
    "qwen3-0.6b lm_head": (151936, 1024),
    "llama3-8b qkv": (6144, 4096),
    "llama3-8b o_proj": (4096, 4096),
    "llama3-8b gate_up": (28672, 4096),
    "llama3-8b down": (4096, 14336),
}
COLS = ["shape", "M", "cublas_us", "gemv_us", "gemv/cublas", "gemv_GBps", "floor_us", "gemv/floor"]
FUSED_COLS = ["shape", "M", "unfused_us", "fused_us", "fused/unfused", "fused/floor"]


def timed_us(n: int, k: int, m: int, fn, x_cols: int | None = None) -> float:
    """Microseconds per ``fn(x, w)`` for x [m, x_cols or k], each call taking the next cold weight [n, k]."""
    copies = max(1, min(64, math.ceil(COLD_BYTES / (n * k * 2))))
    weights = [torch.randn(n, k, device="cuda", dtype=DT) * k**-0.5 for _ in range(copies)]
    x = torch.randn(m, x_cols or k, device="cuda", dtype=DT)
    step = itertools.count()
    return graph_time_ms(lambda: fn(x, weights[next(step) % copies]), calls=max(20, copies)) * 1e3


def bench_shape(name: str, m: int, bw: float, sms: int) -> dict:
    n, k = SHAPES[name]
    nbytes = (n * k + m * k + m * n) * 2
    floor_us = nbytes / bw * 1e6
    cublas = timed_us(n, k, m, F.linear)
    ours = timed_us(n, k, m, gemv)
    return {"shape": name, "M": m, "N": n, "K": k, "cublas_us": cublas, "gemv_us": ours,
            "gemv/cublas": ours / cublas, "gemv_GBps": nbytes / ours / 1e3, "floor_us": floor_us,
            "gemv/floor": ours / floor_us, "config": vars(choose_config(m, n, k, sms))}  # fmt: skip


def bench_fused(name: str, m: int, bw: float) -> dict:
    """Down projection with its activation: silu_mul_gemv against silu_and_mul + F.linear."""
    n, k = SHAPES[name]
    floor_us = (n * k + 2 * m * k + m * n) * 2 / bw * 1e6
    unfused = timed_us(n, k, m, lambda gu, w: F.linear(silu_and_mul(gu), w), x_cols=2 * k)
    fused = timed_us(n, k, m, silu_mul_gemv, x_cols=2 * k)
    return {"shape": name, "M": m, "unfused_us": unfused, "fused_us": fused,
            "fused/unfused": fused / unfused, "fused/floor": fused / floor_us}  # fmt: skip


def candidates(k: int) -> list[GemvConfig]:
    """The tile grid --sweep times: FMA tiles of 64 or 128 weight elements per thread, and dot tiles."""
    out = []
    for bn, per_thread in itertools.product((4, 8, 16, 32), (64, 128)):
        bk = per_thread * 32 * 4 // bn
        if bk <= max(256, k):
            out.append(GemvConfig(bn, bk, num_warps=4, num_stages=2, use_dot=False))
    for bn, bk in itertools.product((16, 32, 64), (64, 128, 256)):
        out.append(GemvConfig(bn, bk, num_warps=4, num_stages=3, use_dot=True))
    return out


def sweep(name: str, m: int, sms: int) -> dict:
    n, k = SHAPES[name]
    chosen = choose_config(m, n, k, sms)
    times = {}
    for cfg in dict.fromkeys([chosen, *candidates(k)]):
        try:
            times[cfg] = timed_us(n, k, m, lambda x, w, c=cfg: gemv(x, w, config=c))
        except Exception as e:  # a tile too large for this card's shared memory: skipped, and said so
            print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:80]}")
    best = min(times, key=times.get)
    row = {"shape": name, "M": m, "chosen_us": times[chosen], "best_us": times[best],
           "chosen/best": times[chosen] / times[best], "chosen": str(chosen), "best": str(best)}  # fmt: skip
    print_table([row], list(row))
    return row


def largest_winning_m(rows: list[dict], ratio: str) -> dict[str, int]:
    """Per shape, the largest M below which (inclusive) every measured M has ``ratio`` < 1."""
    out: dict[str, int] = {}
    for name in dict.fromkeys(r["shape"] for r in rows):
        best = 0
        for r in sorted((r for r in rows if r["shape"] == name), key=lambda r: r["M"]):
            if r[ratio] >= 1.0:
                break
            best = r["M"]
        out[name] = best
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), metavar="SHAPE")
    p.add_argument("--batches", nargs="+", type=int, default=BATCHES)
    p.add_argument("--sweep", action="store_true",
                   help="also time a grid of tile configs per shape and batch (minutes each: narrow it with "
                        "--shapes and --batches)")  # fmt: skip
    args = p.parse_args()
    sms = sm_count(torch.device("cuda"))
    read = measured_read_bw()
    bw_gbs = read.best_gbs
    bw = bw_gbs * 1e9
    print(f"probes: {read.describe()}; {sms} SMs, {torch.cuda.get_device_name(0)}")
    rows = []
    for name in args.shapes:
        for m in args.batches:
            rows.append(bench_shape(name, m, bw, sms))
            print_table([rows[-1]], COLS)
    fused = [bench_fused(name, m, bw) for name in args.shapes if name.endswith("down") for m in args.batches]
    print()
    print_table(rows, COLS)
    if fused:
        print()
        print_table(fused, FUSED_COLS)
    per_shape = largest_winning_m(rows, "gemv/cublas")
    fused_per_shape = largest_winning_m(fused, "fused/unfused")
    print()
    for name, m in per_shape.items():
        extra = f" (fused with its activation: up to M = {fused_per_shape[name]})" if name in fused_per_shape else ""
        print(f"{name}: gemv beats cuBLAS up to M = {m}{extra}")
    gemv_max_m = min(per_shape.values())
    print(f"GEMV_MAX_M = {gemv_max_m}  (largest M at which gemv beats cuBLAS on every shape)")
    swept = [sweep(name, m, sms) for name in args.shapes for m in args.batches] if args.sweep else []
    write_result("gemv", {"read_gbs": bw_gbs, "read": read.summary(), "sm_count": sms, "dtype": str(DT), "gemv_max_m": gemv_max_m,
                          "largest_winning_m": per_shape, "fused_largest_winning_m": fused_per_shape,
                          "rows": rows, "fused": fused, "sweep": swept})  # fmt: skip


if __name__ == "__main__":
    main()
