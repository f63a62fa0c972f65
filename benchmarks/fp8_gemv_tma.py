"""Would a TMA-fed weight stream make the one-row FP8 matmul faster? An experiment, not an engine path.

kernels/fp8_gemv.py loads its weight tiles with ordinary vectorised loads. cuBLAS's one-row matmul, the
fastest reader of benchmarks/roofline.py, feeds its tiles through the Hopper tensor-memory accelerator
(TMA). ``tma_gemv_kernel`` here is the smallest kernel that does the same for an fp8 weight with
per-channel scales (llama3-8b's ``--quantization fp8`` layout): a host-built tensor descriptor, one
``[block_n, block_k]`` tile a step into shared memory through the software pipeline (``stages`` deep),
fp32 multiply-adds against one bf16 row of x, split along K with fp32 atomics where asked. Each shape is
timed against the engine's streaming kernel with the routing table's tiles for one row, both as CUDA
graphs of back-to-back calls over cold weight copies (benchmarks/fp8_route.ColdWeights), next to the read
probe of the same run; every candidate's output is checked against the dequantized product first.

Run: python3 -m benchmarks.fp8_gemv_tma   (writes benchmarks/results/fp8_gemv_tma.json)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from benchmarks.common import print_table, write_result
from benchmarks.fp8_route import SHAPES, ColdWeights
from benchmarks.roofline import measured_read_bw
from graphserve.kernels.fp8_config import rule_for
from graphserve.kernels.fp8_gemv import fp8_gemv

TILES = [(bn, bk, stages) for bn in (8, 16, 32) for bk in (128, 256) for stages in (4, 8)]


@triton.jit
def tma_gemv_kernel(x_ptr, w_desc, ws_ptr, out_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    STAGES: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """out[n] (+)= ws[n] * sum_k w[n, k] * x[k] over this program's rows and K share; w through its descriptor."""
    n0 = tl.program_id(0) * BLOCK_N
    share: tl.constexpr = K // SPLIT
    k_first = tl.program_id(1) * share
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kk in tl.range(0, share, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([n0, k_first + kk])
        x = tl.load(x_ptr + k_first + kk + offs_k).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    offs_n = n0 + tl.arange(0, BLOCK_N)
    out = tl.sum(acc, axis=1) * tl.load(ws_ptr + offs_n)
    if SPLIT == 1:
        tl.store(out_ptr + offs_n, out)
    else:
        tl.atomic_add(out_ptr + offs_n, out, sem="relaxed")


def tma_gemv(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, desc, out: torch.Tensor, bn: int, bk: int,
             stages: int, split: int) -> torch.Tensor:  # fmt: skip
    n, k = w.shape
    if n % bn or k % (split * bk):  # the kernel has no masks: whole tiles only
        raise ValueError(f"tma_gemv: the weight [{n}, {k}] must hold whole tiles: n a multiple of block_n={bn}, k a "
                         f"multiple of split * block_k = {split} * {bk}")
    if split > 1:
        out.zero_()
    tma_gemv_kernel[(n // bn, split)](x, desc, ws, out, K=k, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, SPLIT=split,
                                      num_warps=4)  # fmt: skip
    return out


def measure(name: str, bw) -> dict:
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, k = SHAPES[name]
    cold = ColdWeights(n, k, channel=True)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    route = rule_for(x.device).route(1, n, k, "channel")
    cfg = route.config if route is not None and route.path == "stream" else None
    row = {"shape": name, "n": n, "k": k, "weight_bytes": cold.nbytes,
           "engine_tiles": None if cfg is None else f"{cfg.block_n}x{cfg.block_k} split{cfg.split_k}",
           "engine_us": cold.time_us(lambda wt: fp8_gemv(x, wt[0], wt[1], 1, k, config=cfg))}
    wq, ws, _ = cold.fp8[0]
    want = x.float() @ (wq.float() * ws).T  # every candidate's check, on the first copy
    candidates = []
    for bn, bk, stages in TILES:
        descs = {id(wt[0]): TensorDescriptor.from_tensor(wt[0], [bn, bk]) for wt in cold.fp8}
        for split in (1, 2) if n < 8192 else (1,):
            out = torch.empty(n, device="cuda", dtype=torch.float32)
            got = tma_gemv(x, wq, ws.view(-1), descs[id(wq)], out, bn, bk, stages, split)
            err = float((got[None] - want).norm() / want.norm())
            if err > 1e-4:
                raise AssertionError(f"{name} {bn}x{bk} s{stages} split{split}: relative error {err:.2e}")
            us = cold.time_us(lambda wt, o=out, d=descs, a=(bn, bk, stages, split):
                              tma_gemv(x, wt[0], wt[1].view(-1), d[id(wt[0])], o, *a))  # fmt: skip
            candidates.append({"tile": f"{bn}x{bk} s{stages} split{split}", "us": us})
    best = min(candidates, key=lambda c: c["us"])
    floor_us = bw.floor_ms(row["weight_bytes"]) * 1e3
    row.update({"tma_best_tile": best["tile"], "tma_us": best["us"], "floor_us": floor_us,
                "engine/floor": row["engine_us"] / floor_us, "tma/floor": best["us"] / floor_us,
                "tma/engine": best["us"] / row["engine_us"], "candidates": candidates})
    return row


def main() -> None:
    bw = measured_read_bw()
    print(f"probes: {bw.describe()}")
    rows = [measure(name, bw) for name in SHAPES if name.startswith("llama3-8b")]
    print_table(rows, ["shape", "engine_tiles", "engine_us", "tma_best_tile", "tma_us", "floor_us", "engine/floor",
                       "tma/floor", "tma/engine"])
    write_result("fp8_gemv_tma", {"read": bw.summary(), "rows": rows})


if __name__ == "__main__":
    main()
