"""The FP8 streaming matmul's persistent grid, for a few rows of x against per-channel weights (decode at
batch 1-16): every program streams the same number of weight bytes, so all of them finish together.

The tiled launch (kernels/fp8_gemv.py) gives each program one ``[BLOCK_N, K]`` slab. At one row of x a
Llama-3-8B projection is 512-768 such slabs for ~660 resident programs on an H200: the grid ends in a
partial wave, or with some SMs holding one slab more than others, and a 16-25 MB projection then ran at
58% of the read bandwidth where the 117 MB gate_up, 3584 slabs, ran at 86%
(benchmarks/results/fp8_route_channel.json). Here the grid is ``programs_per_sm`` programs on every SM,
and the work is cut finer than slabs: a unit is one ``[BLOCK_N, BLOCK_K]`` tile, the units are numbered
slab by slab, and program ``p`` takes units ``[p * U // P, (p + 1) * U // P)`` (stream-K). Every program
streams within one unit of the same bytes, in one loop, with as many loads in flight as the programs
resident on an SM hold.

A slab cut by a program boundary is finished by two programs (at most two: the grid never has more
programs than slabs, so each program's range spans at least one slab's units). Each writes its fp32
partial to the boundary's two slots and counts itself done on the boundary's counter (acq_rel at GPU
scope, after a barrier that orders the block's stores); the one that arrives second adds the slots in
slot order (the same sum whichever came first), applies the epilogue, and resets the counter for the
next call and graph replay, as the split-K launch does. A slab within one program is stored directly.

Prologues as the tiled kernel's FMA path (kernels/gemv.py's ``_x_tile``): residual add + RMSNorm (each
program takes the rows' statistics itself; program 0 writes x + residual) or SiLU·mul, computed while x
is loaded. Per-channel scales only (one scale per weight row, applied once in the epilogue); block
scales keep the tiled launch, whose programs own whole rows of scale blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import interpreting
from graphserve.kernels.gemv import _x_tile
from graphserve.kernels.pdl import pdl_args, pdl_release, pdl_wait


@triton.jit
def _fp8_gemv_persistent_kernel(
    x_ptr, res_ptr, nw_ptr, res_out_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, stride_xm, stride_rm, stride_rom, stride_wn, stride_om, eps,
    SILU_MUL: tl.constexpr, ADD_RESIDUAL: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
    TILES: tl.constexpr, PROGRAMS: tl.constexpr, AHEAD: tl.constexpr, WHILE_LOOP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    pid = tl.program_id(0)
    units: tl.constexpr = TILES * K_STEPS
    u_first = (pid * units) // PROGRAMS
    u_end = ((pid + 1) * units) // PROGRAMS
    offs_m = tl.arange(0, BLOCK_M)
    offs_b = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:
        # the rows' statistics, as the tiled kernel takes them; program 0 alone writes x + residual
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs_k[None, :]
            row_mask = (offs_m[:, None] < M) & (cols < K)
            h = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, offs_m[:, None], cols, row_mask, rstd[:, None],
                        K, False, ADD_RESIDUAL, False, x_ptr.dtype.element_ty)  # fmt: skip
            if ADD_RESIDUAL:
                tl.store(res_out_ptr + offs_m[:, None] * stride_rom + cols, h, mask=row_mask & (pid == 0))
            hf = h.to(tl.float32)
            sum_sq += tl.sum(hf * hf, axis=1)
        rstd = 1.0 / tl.sqrt(sum_sq / K + eps)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # the tiles of the next AHEAD units are in flight while a unit is summed: loaded one loop turn ahead per
    # stage, held in registers (a loop with stores in it gets no software pipelining from the compiler)
    w1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=w_ptr.dtype.element_ty)
    if AHEAD > 0:
        w1 = _load_unit(w_ptr, u_first, u_end, N, stride_wn, offs_b, offs_k, K, BLOCK_N, BLOCK_K, K_STEPS)
    w2 = w1
    if AHEAD == 2:
        w2 = _load_unit(w_ptr, u_first + 1, u_end, N, stride_wn, offs_b, offs_k, K, BLOCK_N, BLOCK_K, K_STEPS)
    if WHILE_LOOP:  # the interpreter takes no runtime range bound (kernels/common.interpreting)
        u = u_first
        while u < u_end:
            acc, w1, w2 = _turn(u, acc, w1, w2, u_first, u_end, pid, rstd, x_ptr, res_ptr, nw_ptr, w_ptr, ws_ptr, b_ptr,
                                out_ptr, part_ptr, lock_ptr, M, N, stride_xm, stride_rm, stride_wn, stride_om, offs_m,
                                offs_b, offs_k, SILU_MUL, ADD_RESIDUAL, NORM, HAS_BIAS, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                K_STEPS, AHEAD)  # fmt: skip
            u += 1
    else:
        for u in range(u_first, u_end):
            acc, w1, w2 = _turn(u, acc, w1, w2, u_first, u_end, pid, rstd, x_ptr, res_ptr, nw_ptr, w_ptr, ws_ptr, b_ptr,
                                out_ptr, part_ptr, lock_ptr, M, N, stride_xm, stride_rm, stride_wn, stride_om, offs_m,
                                offs_b, offs_k, SILU_MUL, ADD_RESIDUAL, NORM, HAS_BIAS, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                K_STEPS, AHEAD)  # fmt: skip
    pdl_release(PDL)


@triton.jit
def _load_unit(w_ptr, u, u_end, N, stride_wn, offs_b, offs_k, K: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr):  # fmt: skip
    """The fp8 tile of unit ``u`` (slab u // K_STEPS, K step u % K_STEPS); nothing is read past ``u_end``."""
    tile = u // K_STEPS
    cols = (u - tile * K_STEPS) * BLOCK_K + offs_k
    w_rows = tl.minimum(tile * BLOCK_N + offs_b, N - 1).to(tl.int64)  # rows past N re-read row N-1
    mask = (cols < K)[None, :] & (u < u_end)
    return tl.load(w_ptr + w_rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _turn(
    u, acc, w1, w2, u_first, u_end, pid, rstd, x_ptr, res_ptr, nw_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr,
    lock_ptr, M, N, stride_xm, stride_rm, stride_wn, stride_om, offs_m, offs_b, offs_k,
    SILU_MUL: tl.constexpr, ADD_RESIDUAL: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
    AHEAD: tl.constexpr,
):  # fmt: skip
    """One loop turn: the load of unit u + AHEAD + 1 issued, unit u (its tile ``w1``, loaded earlier) summed into
    ``acc``, and where this program's piece of the slab ends, the slab's store (or its partial for the
    boundary's other program). Returns (acc, the tiles of the next two units)."""
    if AHEAD == 0:
        w = _load_unit(w_ptr, u, u_end, N, stride_wn, offs_b, offs_k, K, BLOCK_N, BLOCK_K, K_STEPS)
        w_next, w_after = w1, w2
    elif AHEAD == 1:
        w = w1
        w_next = _load_unit(w_ptr, u + 1, u_end, N, stride_wn, offs_b, offs_k, K, BLOCK_N, BLOCK_K, K_STEPS)
        w_after = w_next
    else:
        w = w1
        w_next = w2
        w_after = _load_unit(w_ptr, u + 2, u_end, N, stride_wn, offs_b, offs_k, K, BLOCK_N, BLOCK_K, K_STEPS)
    wf = w.to(tl.float32)
    tile = u // K_STEPS
    step = u - tile * K_STEPS
    offs_n = tile * BLOCK_N + offs_b
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    cols = step * BLOCK_K + offs_k
    for m in tl.static_range(BLOCK_M):
        rstd_m = tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
        xr = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, m, cols, (cols < K) & (m < M), rstd_m, K,
                     SILU_MUL, ADD_RESIDUAL, NORM, x_ptr.dtype.element_ty).to(tl.float32)  # fmt: skip
        part = tl.sum(wf * xr[None, :], axis=1)
        acc += tl.where(offs_m[None, :] == m, part[:, None], 0.0)
    if (step == K_STEPS - 1) | (u == u_end - 1):  # this program's piece of the slab ends here
        started = tile * K_STEPS >= u_first
        if started & (step == K_STEPS - 1):
            _store(acc, ws_ptr, b_ptr, out_ptr, offs_m, offs_n, w_rows, M, N, stride_om, HAS_BIAS)
        else:
            # a slab across the boundary with the next program (its first piece, slot 0) or the one before
            # (its second, slot 1): boundary b's slots and counter
            boundary = tl.where(started, pid, pid - 1)
            slot = tl.where(started, 0, 1)
            slots = part_ptr + boundary.to(tl.int64) * (2 * BLOCK_N * BLOCK_M)
            cell = offs_b[:, None] * BLOCK_M + offs_m[None, :]
            tl.store(slots + slot * (BLOCK_N * BLOCK_M) + cell, acc)
            tl.debug_barrier()  # every thread's partial is written before the block counts itself done
            done = tl.atomic_add(lock_ptr + boundary, 1, sem="acq_rel", scope="gpu")
            if done == 1:
                total = tl.load(slots + cell, cache_modifier=".cg")  # slot order, whoever came second
                total += tl.load(slots + BLOCK_N * BLOCK_M + cell, cache_modifier=".cg")
                _store(total, ws_ptr, b_ptr, out_ptr, offs_m, offs_n, w_rows, M, N, stride_om, HAS_BIAS)
                tl.atomic_xchg(lock_ptr + boundary, 0, sem="relaxed", scope="gpu")
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    return acc, w_next, w_after


@triton.jit
def _store(acc, ws_ptr, b_ptr, out_ptr, offs_m, offs_n, w_rows, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """Per-channel scale, bias, and the store of a [BLOCK_N, BLOCK_M] fp32 slab in the output dtype."""
    n_mask = offs_n < N
    acc *= tl.load(ws_ptr + w_rows)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_m[None, :] < M))


def persistent_constants(m: int, n: int, k: int, block_n: int, block_k: int, programs_per_sm: int, sms: int,
                         stages: int = 1) -> dict:
    """The kernel's constexprs: at most one program per slab (``TILES``), ``programs_per_sm`` on every SM, each
    with ``stages`` units' tiles in flight (``AHEAD`` = stages - 1 loaded before the one being summed; 1-3)."""
    if not 1 <= stages <= 3:
        raise ValueError(f"the persistent grid keeps 1-3 units in flight a program (num_stages), got {stages}")
    ahead = stages - 1
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    tiles = triton.cdiv(n, block_n)
    return {"K": k, "BLOCK_M": triton.next_power_of_2(m), "BLOCK_N": block_n, "BLOCK_K": block_k,
            "K_STEPS": triton.cdiv(k, block_k), "TILES": tiles, "PROGRAMS": min(tiles, sms * programs_per_sm),
            "AHEAD": ahead, "WHILE_LOOP": interpreting()}


def launch_persistent(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
    consts: dict, num_warps: int, counters: torch.Tensor, silu_mul: bool, norm_weight: torch.Tensor | None,
    eps: float, residual: torch.Tensor | None, residual_out: torch.Tensor | None,
) -> None:  # fmt: skip
    """One launch on operands kernels/fp8_gemv.py has checked (per-channel ``w_scale`` [N, 1]); ``counters``
    zeroed int32, one per program (split_counters), left zero."""
    programs = consts["PROGRAMS"]
    parts = torch.empty(programs * 2 * consts["BLOCK_N"] * consts["BLOCK_M"], dtype=torch.float32, device=x.device)
    placeholder = out
    _fp8_gemv_persistent_kernel[(programs,)](
        x, residual if residual is not None else placeholder, norm_weight if norm_weight is not None else placeholder,
        residual_out if residual_out is not None else placeholder, w, w_scale,
        bias if bias is not None else placeholder, out, parts, counters, x.shape[0], w.shape[0], x.stride(0),
        residual.stride(0) if residual is not None else 0, residual_out.stride(0) if residual_out is not None else 0,
        w.stride(0), out.stride(0), float(eps), SILU_MUL=silu_mul, ADD_RESIDUAL=residual is not None,
        NORM=norm_weight is not None, HAS_BIAS=bias is not None, **consts, num_warps=num_warps, num_stages=1,
        **pdl_args(x.device, "_fp8_gemv_persistent_kernel"),
    )  # fmt: skip
