"""Each Triton kernel against its PyTorch reference and against the floor of its own work.

Floor: bytes the kernel must move / the best read bandwidth of this run, or, for prefill attention,
the larger of that and its FLOPs / measured bf16 matmul peak. The bandwidth is the best of
benchmarks.roofline's probes and of the rates the kernel rows reach, so no kernel can
beat its floor (an earlier floor from a torch.sum alone was beaten, at ratios 0.94-0.98; rows that
write as well as read are observed too, their writes counted);
``ratio_datasheet`` is the same time against the card's datasheet bandwidth. Kernel time is taken
from CUDA-graph replay, which is how decode runs in the engine and which removes Python launch
cost; ``eager_ms`` is one plain call, launch cost included. ``ratio`` is kernel time over floor:
1.0 would be perfect.
Run on a GPU: python3 -m benchmarks.kernels [--quick]   (writes benchmarks/results/kernels.json)
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.roofline import ReadBandwidth, matmul_tflops, measured_read_bw
from graphserve.kernels.activation import silu_and_mul, silu_and_mul_reference
from graphserve.kernels.common import sm_count
from graphserve.kernels.decode_attention import (
    choose_num_splits,
    counters_numel,
    decode_attention,
    decode_attention_reference,
    workspace_numel,
)
from graphserve.kernels.extend_attention import extend_attention, extend_attention_reference
from graphserve.kernels.kv_write import kv_write, kv_write_reference
from graphserve.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_reference
from graphserve.kernels.rotary import apply_rotary, apply_rotary_reference, rotary_cos_sin
from graphserve.tuning.timing import CapturedCalls, graph_time_ms  # noqa: F401  (re-exported for the benchmarks)

DT = torch.bfloat16
HQ, HKV, D, PAGE = 32, 8, 128, 16  # Llama-3-8B attention shape
COLS = ["kernel", "shape", "eager_ms", "torch_ms", "triton_ms", "speedup", "floor_ms", "ratio", "ratio_datasheet"]


def paged(batch: int, ctx: int):
    blocks = (ctx + PAGE - 1) // PAGE
    cache = torch.randn(2, batch * blocks + 1, PAGE, HKV, D, device="cuda", dtype=DT)
    tables = (torch.randperm(batch * blocks, device="cuda").int() + 1).view(batch, blocks)
    return cache, tables, torch.full((batch,), ctx, dtype=torch.int32, device="cuda")


def row(kernel: str, shape: str, fast, ref, nbytes: float, flops: float = 0.0, ref_iters: int = 10) -> dict:
    """Times of one kernel and the work it must do; ``add_ratios`` puts it against the run's floor."""
    eager = cuda_time_ms(fast, warmup=5, iters=50)
    t = graph_time_ms(fast)
    r = cuda_time_ms(ref, warmup=2, iters=ref_iters)
    out = {"kernel": kernel, "shape": shape, "eager_ms": eager, "torch_ms": r, "triton_ms": t, "speedup": r / t,
           "bytes": nbytes, "flops": flops}  # fmt: skip
    print_table([out], COLS[:6])
    return out


def add_ratios(rows: list[dict], bw: ReadBandwidth, peak: float) -> None:
    """Every row against the best bytes-per-second any row or probe reached in this run (the rows that also
    write count their writes, as a copy's two sides together outrun a read alone), so none beats its floor."""
    for r in rows:
        bw.observe(f"{r['kernel']} {r['shape']}", r["bytes"], r["triton_ms"])
    for r in rows:
        r.update(bw.ratios(r["triton_ms"], r["bytes"], r["flops"], peak))


def bench_decode(batch: int, ctx: int) -> dict:
    cache, tables, lens = paged(batch, ctx)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DT)
    ws = torch.empty(workspace_numel(HQ, HKV, D, sm_count(q.device)), device="cuda")
    counters = torch.zeros(max(1, counters_numel(HKV, sm_count(q.device))), dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    nbytes = 2 * batch * ctx * HKV * D * 2 + 2 * q.numel() * 2 + tables.numel() * 4
    splits = choose_num_splits(batch, HKV, tables.shape[1] * PAGE, sm_count(q.device))
    return row(
        "decode_attention", f"bs{batch} ctx{ctx} splits{splits}",
        lambda: decode_attention(q, cache, tables, lens, D**-0.5, out=out, workspace=ws, counters=counters),
        lambda: decode_attention_reference(q, cache, tables, lens, D**-0.5),
        nbytes, ref_iters=3,
    )  # fmt: skip


def bench_extend(batch: int, prefix: int, qlen: int) -> dict:
    ctx = prefix + qlen
    cache, tables, lens = paged(batch, ctx)
    q = torch.randn(batch * qlen, HQ, D, device="cuda", dtype=DT)
    starts = torch.arange(0, batch * qlen + 1, qlen, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    visible = batch * (qlen * prefix + qlen * (qlen + 1) / 2)  # (query, key) pairs under the causal mask
    flops = 4 * visible * HQ * D
    nbytes = 2 * batch * ctx * HKV * D * 2 + 2 * q.numel() * 2
    return row(
        "extend_attention", f"bs{batch} prefix{prefix} new{qlen}",
        lambda: extend_attention(q, cache, tables, lens, starts, qlen, D**-0.5, out=out),
        lambda: extend_attention_reference(q, cache, tables, lens, starts, D**-0.5),
        nbytes, flops, ref_iters=3,
    )  # fmt: skip


def bench_elementwise(tokens: int) -> list[dict]:
    rows = []
    cache, _, _ = paged(1, tokens + PAGE)
    k = torch.randn(tokens, HKV, D, device="cuda", dtype=DT)
    v = torch.randn_like(k)
    slots = torch.randperm(tokens, device="cuda") + PAGE
    kv_bytes = 4 * k.numel() * 2 + slots.numel() * 8
    rows.append(row("kv_write", f"T{tokens}", lambda: kv_write(k, v, cache, slots),
                    lambda: kv_write_reference(k, v, cache, slots), kv_bytes))  # fmt: skip
    hidden = 4096
    x = torch.randn(tokens, hidden, device="cuda", dtype=DT)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=DT)
    rows.append(row("fused_add_rms_norm", f"T{tokens} H{hidden}", lambda: fused_add_rms_norm(x, res, w, 1e-5),
                    lambda: fused_add_rms_norm_reference(x, res, w, 1e-5), 4 * x.numel() * 2))  # fmt: skip
    cos, sin = rotary_cos_sin(8192, D, device="cuda")
    q = torch.randn(tokens, HQ, D, device="cuda", dtype=DT)
    kk = torch.randn(tokens, HKV, D, device="cuda", dtype=DT)
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    rot_bytes = 2 * (q.numel() + kk.numel()) * 2 + tokens * D * 4
    rows.append(row("apply_rotary", f"T{tokens} {HQ}/{HKV}x{D}", lambda: apply_rotary(q, kk, pos, cos, sin),
                    lambda: apply_rotary_reference(q, kk, pos, cos, sin), rot_bytes))  # fmt: skip
    inter = 14336
    gu = torch.randn(tokens, 2 * inter, device="cuda", dtype=DT)
    rows.append(row("silu_and_mul", f"T{tokens} I{inter}", lambda: silu_and_mul(gu),
                    lambda: silu_and_mul_reference(gu), 3 * tokens * inter * 2))  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    args = p.parse_args()
    bw, peak = measured_read_bw(), matmul_tflops()
    print(f"probes: {bw.describe()}; bf16 matmul peak {peak:.0f} TFLOP/s")
    rows = []
    decode_shapes = [(1, 8192), (8, 4096), (64, 2048), (256, 1024)]
    if not args.quick:
        decode_shapes += [(1, 1024), (32, 8192), (256, 4096)]
    for batch, ctx in decode_shapes:
        rows.append(bench_decode(batch, ctx))
    for batch, prefix, qlen in [(1, 0, 4096), (4, 0, 1024), (2, 4096, 512)]:
        rows.append(bench_extend(batch, prefix, qlen))
    for tokens in [256, 8192] if not args.quick else [8192]:
        rows += bench_elementwise(tokens)
    add_ratios(rows, bw, peak)
    print()
    print(f"floor: {bw.describe()}")
    print_table(rows, COLS)
    write_result("kernels", {"read": bw.summary(), "matmul_tflops": peak, "dtype": str(DT), "rows": rows})


if __name__ == "__main__":
    main()
