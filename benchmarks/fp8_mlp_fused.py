"""Would one launch for a one-row FP8 MLP (gate_up, SiLU·mul, down) beat the engine's two? An experiment, not an
engine path.

At batch 1 a decoder layer's MLP is two weight streams: ``fp8_norm_gemv`` on gate_up (the residual add and RMSNorm
in its loads) and ``fp8_silu_mul_gemv`` on down (SiLU·mul in its loads). Between them the GPU drains one grid and
starts the next from cold. ``fused_mlp_kernel`` here runs both in one persistent grid of one program per SM: phase
A streams gate_up tiles and writes h = silu(gate) * up; a grid-wide barrier (an arrival counter at GPU scope, the
last program resetting it) orders h before phase B; and each program asks for its first down tile before it
waits at the barrier (the weight is no kernel's output), so the down stream's first bytes overlap phase A's tail.
The grid must be co-resident for the barrier (one program an SM, nothing else running); the benchmark runs it
alone. ``phase`` 1 and 2 run the phases as two launches instead (Triton's interpreter runs programs one after
another, where a barrier would never open: the CPU test checks the arithmetic so).

Per-channel FP8 weights (llama3-8b's ``--quantization fp8`` layout), one bf16 row; the roundings are the engine's:
x + residual and the norm as kernels/gemv._x_tile, gate and up rounded to bf16 as the gate_up projection's output,
h as silu_and_mul's. Timed against the engine's two launches with the routing table's tiles, both as CUDA graphs of
back-to-back layers over cold weight copies, next to the read probe of the same run; each candidate's output is
checked against the engine's first.

Run: python3 -m benchmarks.fp8_mlp_fused   (writes benchmarks/results/fp8_mlp_fused.json)
"""

from __future__ import annotations

import itertools
import math

import torch
import triton
import triton.language as tl

from benchmarks.common import print_table, write_result
from graphserve.kernels.common import sm_count

HIDDEN, INTERMEDIATE = 4096, 14336  # llama3-8b
COLD_BYTES = 256 << 20
# (phase A rows, phase A columns a step, phase B rows, phase B columns a step, warps, stages)
TILES = [(8, 1024, 32, 512, 8, 3), (16, 512, 32, 512, 8, 3), (8, 1024, 16, 1024, 8, 3), (16, 512, 32, 1024, 8, 2)]


@triton.jit
def _normed_chunk(x_ptr, res_ptr, nw_ptr, cols, rstd, NORM: tl.constexpr):
    """x + residual rounded to bf16, then RMSNorm rounded twice (kernels/gemv._x_tile's numerics), in fp32."""
    x = tl.load(x_ptr + cols).to(tl.float32)
    h = (x + tl.load(res_ptr + cols).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + cols).to(tl.float32)
        h = ((h * rstd).to(tl.bfloat16).to(tl.float32) * nw).to(tl.bfloat16).to(tl.float32)
    return h


@triton.jit
def _down_tile(acc, wd_ptr, h_ptr, rows, k_start, INTER: tl.constexpr, BK_B: tl.constexpr):
    offs_k = tl.arange(0, BK_B)
    for k0 in range(k_start, INTER, BK_B):
        w = tl.load(wd_ptr + rows[:, None].to(tl.int64) * INTER + k0 + offs_k[None, :])
        h = tl.load(h_ptr + k0 + offs_k, cache_modifier=".cg").to(tl.float32)  # other programs' h: from L2
        acc += w.to(tl.float32) * h[None, :]
    return acc


@triton.jit
def fused_mlp_kernel(
    x_ptr, res_ptr, nw_ptr, wgu_ptr, sgu_ptr, wd_ptr, sd_ptr, h_ptr, out_ptr, sync_ptr, eps, programs,
    H: tl.constexpr, INTER: tl.constexpr, BN_A: tl.constexpr, BK_A: tl.constexpr, BN_B: tl.constexpr,
    BK_B: tl.constexpr, PHASE: tl.constexpr,
):  # fmt: skip
    """PHASE 0: both phases and the barrier between them; 1: phase A alone; 2: phase B alone."""
    pid = tl.program_id(0)  # of ``programs``, the grid
    TILES_B: tl.constexpr = H // BN_B
    if PHASE != 2:
        offs_k = tl.arange(0, BK_A)
        sum_sq = tl.zeros((BK_A,), dtype=tl.float32)
        for k0 in range(0, H, BK_A):  # every program takes the row's statistics itself (a few KB from L2)
            hx = _normed_chunk(x_ptr, res_ptr, nw_ptr, k0 + offs_k, 0.0, False)
            sum_sq += hx * hx
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / H + eps)
        t = pid  # while loops over tiles: the interpreter's range takes no program id
        while t < INTER // BN_A:
            rows = (t * BN_A + tl.arange(0, BN_A)).to(tl.int64)
            acc_g = tl.zeros((BN_A, BK_A), dtype=tl.float32)
            acc_u = tl.zeros((BN_A, BK_A), dtype=tl.float32)
            for k0 in range(0, H, BK_A):
                xk = _normed_chunk(x_ptr, res_ptr, nw_ptr, k0 + offs_k, rstd, True)
                wg = tl.load(wgu_ptr + rows[:, None] * H + k0 + offs_k[None, :])
                wu = tl.load(wgu_ptr + (INTER + rows)[:, None] * H + k0 + offs_k[None, :])
                acc_g += wg.to(tl.float32) * xk[None, :]
                acc_u += wu.to(tl.float32) * xk[None, :]
            # the gate_up projection's bf16 output, then silu_and_mul's rounding
            g = (tl.sum(acc_g, axis=1) * tl.load(sgu_ptr + rows)).to(tl.bfloat16).to(tl.float32)
            u = (tl.sum(acc_u, axis=1) * tl.load(sgu_ptr + INTER + rows)).to(tl.bfloat16).to(tl.float32)
            tl.store(h_ptr + rows, (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16))
            t += programs
    offs_b = tl.arange(0, BK_B)
    rows_b = pid * BN_B + tl.arange(0, BN_B)
    acc = tl.zeros((BN_B, BK_B), dtype=tl.float32)
    if PHASE == 0:
        # this program's first down tile asked for before the wait (a program past the tiles re-reads tile 0's rows
        # and never uses them), then the barrier: every program's h stored and counted before any reads it
        first_rows = tl.where(pid < TILES_B, rows_b, tl.arange(0, BN_B))
        w_first = tl.load(wd_ptr + first_rows[:, None].to(tl.int64) * INTER + offs_b[None, :])
        tl.debug_barrier()
        tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
        arrived = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        while arrived < programs:
            arrived = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        h0 = tl.load(h_ptr + offs_b, cache_modifier=".cg").to(tl.float32)
        acc += w_first.to(tl.float32) * h0[None, :]
        # every program has passed the wait once the second counter reaches the grid: the last one resets both
        left = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if left == programs - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
    if PHASE != 1:
        K_FIRST: tl.constexpr = BK_B if PHASE == 0 else 0
        if pid < TILES_B:
            acc = _down_tile(acc, wd_ptr, h_ptr, rows_b, K_FIRST, INTER, BK_B)
            tl.store(out_ptr + rows_b, (tl.sum(acc, axis=1) * tl.load(sd_ptr + rows_b)).to(tl.bfloat16))
        t = pid + programs
        while t < TILES_B:
            rows = t * BN_B + tl.arange(0, BN_B)
            acc = _down_tile(tl.zeros((BN_B, BK_B), dtype=tl.float32), wd_ptr, h_ptr, rows, 0, INTER, BK_B)
            tl.store(out_ptr + rows, (tl.sum(acc, axis=1) * tl.load(sd_ptr + rows)).to(tl.bfloat16))
            t += programs


def fused_mlp(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float, wgu, sgu, wd, sd,
              sync: torch.Tensor, programs: int, tile: tuple, split_phases: bool = False) -> torch.Tensor:  # fmt: skip
    """down(silu_mul(gate_up(rms_norm(x + residual)))) for one bf16 row with per-channel FP8 weights ``wgu`` [2I, H]
    (scales ``sgu`` [2I]) and ``wd`` [H, I] (``sd`` [H]); ``sync``: two zeroed int32 counters, left zeroed.
    ``split_phases``: the two phases as two launches (no barrier)."""
    bn_a, bk_a, bn_b, bk_b, warps, stages = tile
    i2, h = wgu.shape
    i = i2 // 2
    if x.shape != (1, h) or wd.shape != (h, i) or i % bn_a or h % bk_a or h % bn_b or i % bk_b:
        raise ValueError(f"fused_mlp: one row of {h} against gate_up {tuple(wgu.shape)} and down {tuple(wd.shape)} in "
                         f"whole tiles ({bn_a}x{bk_a}, {bn_b}x{bk_b}), got x {tuple(x.shape)}")
    if programs < 1:
        raise ValueError(f"fused_mlp: programs={programs}, at least 1")
    if not split_phases:  # the barrier waits for every program: all must be resident at once, one an SM
        if not x.is_cuda:
            raise ValueError("fused_mlp: the one launch needs a GPU (the interpreter runs programs one after another, "
                             "so its barrier would never open): split_phases=True")
        if programs > sm_count(x.device):
            raise ValueError(f"fused_mlp: programs={programs} exceeds the {sm_count(x.device)} SMs; the one launch's "
                             f"barrier needs every program resident")
    hbuf = torch.empty(i, device=x.device, dtype=torch.bfloat16)
    out = torch.empty(1, h, device=x.device, dtype=torch.bfloat16)
    args = (x, residual, norm_w, wgu, sgu, wd, sd, hbuf, out, sync, eps, programs)
    consts = {"H": h, "INTER": i, "BN_A": bn_a, "BK_A": bk_a, "BN_B": bn_b, "BK_B": bk_b}
    for phase in ((1, 2) if split_phases else (0,)):
        fused_mlp_kernel[(programs,)](*args, **consts, PHASE=phase, num_warps=warps, num_stages=stages)
    return out


def engine_mlp(x, residual, norm_w, eps, wgu, sgu, wd, sd, cfg_gu, cfg_d) -> torch.Tensor:
    """The engine's two launches at one row: the norm in gate_up's loads, SiLU·mul in down's."""
    from graphserve.kernels.fp8_gemv import fp8_norm_gemv, fp8_silu_mul_gemv

    gate_up = fp8_norm_gemv(x, norm_w, eps, wgu, sgu.view(-1, 1), 1, x.shape[1], residual=residual, config=cfg_gu)[0]
    return fp8_silu_mul_gemv(gate_up, wd, sd.view(-1, 1), 1, wd.shape[1], config=cfg_d)


def main() -> None:
    from benchmarks.kernels import graph_time_ms
    from benchmarks.roofline import measured_read_bw
    from graphserve.kernels.fp8_config import rule_for
    from graphserve.kernels.fp8_quant import quantize_weight_channels

    bw = measured_read_bw()
    print(f"probes: {bw.describe()}")
    dev = torch.device("cuda")
    h, i = HIDDEN, INTERMEDIATE
    copies = max(2, math.ceil(COLD_BYTES / (3 * h * i)))
    layers = []
    for _ in range(copies):
        wgu, sgu = quantize_weight_channels(torch.randn(2 * i, h, device=dev) * 0.02)
        wd, sd = quantize_weight_channels(torch.randn(h, i, device=dev) * 0.02)
        layers.append((wgu, sgu, wd, sd))
    x = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    norm_w = torch.rand(h, device=dev, dtype=torch.bfloat16) + 0.5
    rule = rule_for(dev)
    cfgs = [getattr(rule.route(1, n, k, "channel"), "config", None) for n, k in ((2 * i, h), (h, i))]
    nbytes = 3 * h * i + 4 * (2 * i + h)
    step = itertools.count()  # each call on the next cold copy

    def engine() -> torch.Tensor:
        return engine_mlp(x, residual, norm_w, 1e-5, *layers[next(step) % copies], *cfgs)

    want = engine_mlp(x, residual, norm_w, 1e-5, *layers[0], *cfgs).float()
    rows = [{"kernel": "engine: fp8_norm_gemv + fp8_silu_mul_gemv", "tile": "routing table",
             "us": graph_time_ms(engine, calls=max(20, copies)) * 1e3}]
    sync = torch.zeros(2, device=dev, dtype=torch.int32)
    programs = sm_count(dev)  # one an SM (the tiles' registers hold one): the barrier needs the grid resident
    for tile in TILES:
        got = fused_mlp(x, residual, norm_w, 1e-5, *layers[0], sync, programs, tile).float()
        err = float((got - want).norm() / want.norm())
        if err > 2e-2 or sync.any():
            raise AssertionError(f"fused_mlp {tile}: relative error {err:.2e} against the engine's, counters "
                                 f"{sync.tolist()}")
        us = graph_time_ms(lambda t=tile: fused_mlp(x, residual, norm_w, 1e-5, *layers[next(step) % copies], sync,
                                                    programs, t), calls=max(20, copies)) * 1e3  # fmt: skip
        rows.append({"kernel": f"fused, {programs} programs", "tile": "x".join(map(str, tile)), "us": us,
                     "error_vs_engine": err})
    floor_us = bw.floor_ms(nbytes) * 1e3
    for r in rows:
        r["floor_us"], r["ratio"] = floor_us, r["us"] / floor_us
        r["vs_engine"] = r["us"] / rows[0]["us"]
    print_table(rows, ["kernel", "tile", "us", "floor_us", "ratio", "vs_engine"])
    write_result("fp8_mlp_fused", {"read": bw.summary(), "weight_bytes": nbytes, "rows": rows})


if __name__ == "__main__":
    main()
