"""Small-batch FP8-weight matmul for decode: ``x @ dequant(w).T`` with x in bf16 and w streamed as fp8.

At 1-64 rows a projection is a weight stream. The W8A8 path would first quantize x (one more launch
and a round trip through memory) for tensor-core work that is not the bottleneck. Here each program
owns ``BLOCK_N`` weight rows for all M rows of x and streams its ``[BLOCK_N, K]`` fp8 slab once (one
byte per weight: half of bf16's traffic) with loads contiguous along K. Three inner products, the
first two as kernels/gemv.py's (W8A16: the tile widened in registers, exact since every e4m3 value is
a bf16 value):

- FMA (small M): fp32 multiply-adds on the CUDA cores, one pass over the tile per row of x;
- dot (larger M, and every M above 16): ``tl.dot(w_tile, x_tile.T)`` with x padded to 16, 32 or 64 rows
  ("swap AB": the weight rows fill the tensor-core tile's tall side);
- FP8 dot (``fp8_dot``): the weight tile stays fp8; x's rows are quantized in registers, one scale per
  row and K step (amax / 448, the step being the scale block's K: the groups
  kernels/fp8_quant.per_token_group_quant makes for the W8A8 paths, so the same rounding), and the
  product runs on the FP8 tensor cores, the two scales applied to each step's fp32 partial (per row of
  the tile where it spans scale blocks, so any height up to 256 rows). No widening of the weight, no
  quantization launch, and the prologues below still apply;
- A8 (``fp8_gemv_a8``, tiles with ``a8``): the FP8 dot on an x quantized by one launch before it
  (kernels/fp8_quant.py, fused there with the norm or SiLU·mul that makes x). Every program reads x
  again from L2, so at 32-64 rows x's reads rival the weight's: fp8 x halves them and no program
  spends registers and cycles quantizing rows another program quantized already. With per-channel weight
  scales and x quantized per token (one scale a row, ``x_scale`` [M, 1]) no scale varies along K: the
  steps accumulate in one FP8 dot chain and both scales multiply the result once (``X_TOKEN``), where
  block scales make every step's partial leave the tensor cores to be scaled.

Scales. A program's rows lie in one row of scale blocks (``BLOCK_N`` divides the block height), so
a 128x128 block scale is a function of k alone within the program: it multiplies x, the small
operand, instead of the weight tile. The FMA path views a tile as ``[BLOCK_N, K blocks, block_k]``
and scales each x sub-row in fp32 (one scale load per K block, exact up to fp32 rounding); the dot
path scales x before rounding it to the tensor cores' 16-bit input, which costs the same 2^-9
relative rounding x already carries. Per-channel scales multiply the fp32 accumulator once.

Prologues, as kernels/gemv.py's: ``fp8_silu_mul_gemv`` computes silu(gate) * up and ``fp8_norm_gemv``
(residual add +) RMSNorm while loading x, so a decoder layer's norm and activation launches vanish
at decode batch sizes.

Gated (``fp8_gate_up_a8``, the a8 FP8 dot on an MLP's merged [gate | up] weight): a program's tile is BLOCK_N / 2
gate rows stacked on the up rows N further on, one tall dot a step, so the epilogue holds gate and up for the same
columns and computes silu(gate) * up (each rounded as the unfused launches round it). With ``QUANT_OUT`` those
BLOCK_N / 2 columns are one group of the down projection's W8A8 input: the epilogue quantizes each row of them
(kernels/fp8_quant.quantize_rows) and writes fp8 plus the group's scale, so gate_up's [M, 2N] output and the
SiLU·mul quantization launch between the two projections are never needed. Split-K sums both halves before it.

Split-K. A tall-K projection (Llama-3-8B's down: K = 14336 against N = 4096) gives each program a long
chain of dependent tile loads and too few programs to keep every SM's memory pipe full. With
``split_k`` > 1 the grid is (column tiles, splits); each program streams its [BLOCK_N, K / split_k] slab
and writes an fp32 partial. The reduction stays in the same launch (a second one costs more than a 4 MB
projection's whole stream): each program counts itself done on its column tile's counter (acq_rel at
GPU scope, after a barrier that orders the block's stores), and the one that finds itself last sums
the partials in split order - the result does not depend on which program finished when - applies the
epilogue and resets the counter to zero for the next call and the next graph replay.

Tiles are a pure function of the shape or come from the measured table (kernels/fp8_config.py); no
autotuning, so the kernel is safe inside CUDA-graph capture. The counters are allocated once per
device and stream; the partials come from the caching allocator (no data-dependent sizes).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import sm_count
from graphserve.kernels.fp8_config import (
    MAX_BLOCK_N,
    MAX_FMA_ROWS,
    MAX_STREAM_ROWS,
    StreamConfig,
    default_stream_config,
    tile_cap,
)
from graphserve.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_SCALE, TL_DTYPES, quantize_rows
from graphserve.kernels.gemv import _x_tile
from graphserve.kernels.pdl import pdl_args, pdl_release, pdl_wait

MAX_ROWS = MAX_STREAM_ROWS
MAX_SPLIT_TILES = 4096  # split-K column tiles per launch (16 KB of counters); split-K pays where tiles are few
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, xs_ptr, res_ptr, nw_ptr, res_out_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, os_ptr, part_ptr, lock_ptr,
    M, N, stride_xm, stride_xsm, stride_xsk, stride_rm, stride_rom, stride_wn, stride_wsn, stride_om, stride_osm, eps,
    SILU_MUL: tl.constexpr, ADD_RESIDUAL: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
    QUANT_OUT: tl.constexpr, ACT_DTYPE: tl.constexpr,
    K: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, KB: tl.constexpr, SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr,
    FP8_DOT: tl.constexpr, A8: tl.constexpr, X_TOKEN: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    pid = tl.program_id(0)
    k_first = tl.program_id(1) * K_SPLIT  # this program's share of K: [k_first, k_first + K_SPLIT)
    # every split full and a whole number of tiles: unmasked weight loads
    FULL: tl.constexpr = K % K_SPLIT == 0
    # GATED: the tile's top half is gate rows, its bottom half the up rows N further on, for HALF output columns
    HALF: tl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
    offs_n = pid * HALF + tl.arange(0, HALF)  # the program's output columns
    offs_m = tl.arange(0, BLOCK_M)
    # rows past N re-read row N-1: unmasked, vectorised weight loads; those columns are never stored
    s_row = ws_ptr + ((pid * HALF) // GROUP_N) * stride_wsn  # this program's row of block scales (gate rows')
    if GATED:
        r = tl.arange(0, BLOCK_N)
        w_rows = (tl.minimum(pid * HALF + r % HALF, N - 1) + tl.where(r < HALF, 0, N)).to(tl.int64)
        s_row_up = ws_ptr + ((N + pid * HALF) // GROUP_N) * stride_wsn  # the up rows' (N a multiple of GROUP_N)
    else:
        w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:
        # as kernels/gemv.py: every program takes the rows' statistics itself (a few KB from L2, cheaper
        # than a norm launch); program 0 alone writes x + residual, into a buffer no program reads
        offs_kk = tl.arange(0, BLOCK_K)
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs_kk[None, :]
            row_mask = (offs_m[:, None] < M) & (cols < K)
            h = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, offs_m[:, None], cols, row_mask, rstd[:, None],
                        K, False, ADD_RESIDUAL, False, x_ptr.dtype.element_ty)  # fmt: skip
            if ADD_RESIDUAL:
                tl.store(res_out_ptr + offs_m[:, None] * stride_rom + cols, h,
                         mask=row_mask & (pid == 0) & (k_first == 0))
            hf = h.to(tl.float32)
            sum_sq += tl.sum(hf * hf, axis=1)
        rstd = 1.0 / tl.sqrt(sum_sq / K + eps)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if USE_DOT:
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + w_rows[:, None] * stride_wn + offs_k[None, :]
        for kk in range(0, K_SPLIT, BLOCK_K):
            k0 = k_first + kk
            cols = k0 + offs_k
            k_mask = cols < K
            if FULL:
                w = tl.load(w_ptrs + k0)
            else:
                w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)
            x_mask = (offs_m[:, None] < M) & k_mask[None, :]
            if A8:  # x came quantized (fp8, one scale per row and BLOCK_K columns): no prologue, no rounding here
                xq = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=x_mask, other=0.0)
                if not X_TOKEN:
                    xs = tl.load(xs_ptr + offs_m * stride_xsm + (k0 // BLOCK_K) * stride_xsk, mask=offs_m < M,
                                 other=0.0)
            else:
                x = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, offs_m[:, None], cols[None, :], x_mask,
                            rstd[:, None], K, SILU_MUL, ADD_RESIDUAL, NORM, x_ptr.dtype.element_ty)  # fmt: skip
            if X_TOKEN:  # one scale per row of x and per weight row: one dot chain, the scales after the loop
                acc = tl.dot(w, tl.trans(xq), acc)
            elif FP8_DOT:
                if not A8:
                    # x's rows quantized per BLOCK_K-wide group as kernels/fp8_quant.per_token_group_quant does
                    # (BLOCK_K is the scale block's K), then both operands on the FP8 tensor cores
                    xq, xs = quantize_rows(x.to(tl.float32), w.dtype, FP8_MAX_C, MIN_SCALE_C)
                part = tl.dot(w, tl.trans(xq)) * xs[None, :]
                if not PER_CHANNEL:
                    if GATED and GROUP_N % HALF == 0:  # one scale for the gate half, one for the up half
                        up_half = tl.arange(0, BLOCK_N) >= HALF
                        part *= tl.where(up_half, tl.load(s_row_up + k0 // GROUP_K),
                                         tl.load(s_row + k0 // GROUP_K))[:, None]
                    elif not GATED and GROUP_N % BLOCK_N == 0:  # one weight scale for the step: the program's row
                        part *= tl.load(s_row + k0 // GROUP_K)
                    else:  # a tile across scale blocks: each row its block's scale
                        part *= tl.load(ws_ptr + (w_rows // GROUP_N) * stride_wsn + k0 // GROUP_K)[:, None]
                acc += part
            else:
                if not PER_CHANNEL:
                    ks = tl.load(s_row + cols // GROUP_K, mask=k_mask, other=0.0)
                    x = (x.to(tl.float32) * ks[None, :]).to(x_ptr.dtype.element_ty)
                acc += tl.dot(w.to(x.dtype), tl.trans(x))
    else:
        # the tile as [BLOCK_N, KB, SUB_K] (KB = BLOCK_K / SUB_K): one scale per SUB_K-long piece of K
        offs_b = tl.arange(0, KB)
        offs_s = tl.arange(0, SUB_K)
        k2 = offs_b[:, None] * SUB_K + offs_s[None, :]  # [KB, SUB_K] column offsets within a tile
        w_ptrs = w_ptr + w_rows[:, None, None] * stride_wn + k2[None, :, :]
        for kk in range(0, K_SPLIT, BLOCK_K):
            k0 = k_first + kk
            cols = k0 + k2
            k_mask = cols < K
            if FULL:
                w = tl.load(w_ptrs + k0)
            else:
                w = tl.load(w_ptrs + k0, mask=k_mask[None, :, :], other=0.0)
            wf = w.to(tl.float32)
            if not PER_CHANNEL:
                piece = k0 + offs_b * SUB_K
                ks = tl.load(s_row + piece // GROUP_K, mask=piece < K, other=0.0)
            for m in tl.static_range(BLOCK_M):
                rstd_m = tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
                xr = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, m, cols, k_mask & (m < M), rstd_m, K,
                             SILU_MUL, ADD_RESIDUAL, NORM, x_ptr.dtype.element_ty).to(tl.float32)  # fmt: skip
                if not PER_CHANNEL:
                    xr = xr * ks[:, None]
                part = tl.sum(tl.sum(wf * xr[None, :, :], axis=2), axis=1)
                acc += tl.where(offs_m[None, :] == m, part[:, None], 0.0)
    if X_TOKEN:
        acc *= tl.load(xs_ptr + offs_m * stride_xsm, mask=offs_m < M, other=0.0)[None, :]
    pdl_release(PDL)  # the next kernel's programs join as these finish streaming (kernels/pdl.py)
    if SPLIT_K == 1:
        _epilogue(acc, ws_ptr, b_ptr, out_ptr, os_ptr, offs_m, offs_n, w_rows, pid, M, N, stride_wsn, stride_om,
                  stride_osm, PER_CHANNEL, HAS_BIAS, GATED, QUANT_OUT, ACT_DTYPE, HALF, BLOCK_M, FP8_MAX_C,
                  MIN_SCALE_C)  # fmt: skip
    else:
        # partials as [column tile, split, BLOCK_N, BLOCK_M] fp32: each program's own contiguous piece
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        parts = part_ptr + pid.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
        tl.store(parts + tl.program_id(1) * (BLOCK_N * BLOCK_M) + tile, acc)
        tl.debug_barrier()  # every thread's partial is written before the block counts itself done
        done = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # split order, whichever program came last: deterministic
                total += tl.load(parts + s * (BLOCK_N * BLOCK_M) + tile, cache_modifier=".cg")
            _epilogue(total, ws_ptr, b_ptr, out_ptr, os_ptr, offs_m, offs_n, w_rows, pid, M, N, stride_wsn,
                      stride_om, stride_osm, PER_CHANNEL, HAS_BIAS, GATED, QUANT_OUT, ACT_DTYPE, HALF, BLOCK_M,
                      FP8_MAX_C, MIN_SCALE_C)  # fmt: skip
            tl.atomic_xchg(lock_ptr + pid, 0, sem="relaxed", scope="gpu")


@triton.jit
def _epilogue(acc, ws_ptr, b_ptr, out_ptr, os_ptr, offs_m, offs_n, w_rows, pid, M, N, stride_wsn, stride_om, stride_osm,
              PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, QUANT_OUT: tl.constexpr,
              ACT_DTYPE: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, FP8_MAX_C: tl.constexpr,
              MIN_SCALE_C: tl.constexpr):  # fmt: skip
    """Per-channel scale, bias, and the store of the fp32 tile ([BLOCK_N, BLOCK_M], rows the output columns).

    GATED: the tile's two halves are gate and up for the same HALF columns; each is rounded to ``ACT_DTYPE``
    as the gate_up projection would store it and silu(gate) * up is rounded again as kernels/gemv.py's
    SiLU·mul prologue and kernels/fp8_quant.silu_mul_group_quant round it. QUANT_OUT: those HALF columns are
    one activation group of the next projection's W8A8 input: each row quantized as that launch would
    (kernels/fp8_quant.quantize_rows), fp8 into ``out_ptr`` and the group's scale into ``os_ptr`` [M, groups]."""
    n_mask = offs_n < N
    if PER_CHANNEL:
        acc *= tl.load(ws_ptr + w_rows * stride_wsn)[:, None]
    if GATED:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, HALF, BLOCK_M)), (1, 2, 0)))
        g = gate.to(ACT_DTYPE).to(tl.float32)
        u = up.to(ACT_DTYPE).to(tl.float32)
        h = (g / (1.0 + tl.exp(-g)) * u).to(ACT_DTYPE)
        if QUANT_OUT:
            # columns past N hold re-read weights: zeros there, as the launch's group past K would load
            hf = tl.where(n_mask[:, None], h.to(tl.float32), 0.0)
            q, scale = quantize_rows(tl.trans(hf), out_ptr.dtype.element_ty, FP8_MAX_C, MIN_SCALE_C)
            tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], q,
                     mask=(offs_m[:, None] < M) & n_mask[None, :])
            tl.store(os_ptr + offs_m * stride_osm + pid, scale, mask=offs_m < M)
        else:
            tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], h,
                     mask=n_mask[:, None] & (offs_m[None, :] < M))
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_m[None, :] < M))


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per column tile, for split-K launches on the current stream.

    Every launch leaves them at zero (the last program of a tile resets its counter), so one buffer
    serves every call and graph replay on a stream; launches on one stream run in order, and another
    stream gets its own buffer. Sized once (MAX_SPLIT_TILES) so no call allocates after the first."""
    if tiles > MAX_SPLIT_TILES:
        raise ValueError(f"fp8_gemv: split-K over {tiles} column tiles, at most {MAX_SPLIT_TILES}: use a wider "
                         f"block_n or split_k=1")
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def _check(x: torch.Tensor, k: int, w: torch.Tensor, w_scale: torch.Tensor, group_n: int, group_k: int,
           bias: torch.Tensor | None, a8: bool = False) -> bool:
    """Validate the operands (x has K columns, 2K for silu_mul; fp8 for ``a8``); True for per-channel scales."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"fp8_gemv takes x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    m, n = x.shape[0], w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {MAX_ROWS} rows, got {m}: larger batches take the W8A8 GEMM")
    if w.shape[1] != k or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} and w {tuple(w.shape)} must be row-major with one K")
    x_dtypes = (FP8_DTYPE,) if a8 else X_DTYPES
    if w.dtype != FP8_DTYPE or x.dtype not in x_dtypes:
        raise ValueError(f"fp8_gemv: w must be {FP8_DTYPE} (got {w.dtype}) and x one of {x_dtypes} (got {x.dtype})")
    per_channel = group_n == 1 and group_k >= k
    want = (n, 1) if per_channel else (-(-n // group_n), -(-k // group_k))
    if w_scale.dim() != 2 or tuple(w_scale.shape) != want or w_scale.stride(-1) != 1:
        raise ValueError(f"fp8_gemv: w_scale has shape {tuple(w_scale.shape)}, expected {want} (row-major) for "
                         f"{group_n}x{group_k} scale blocks of a {tuple(w.shape)} weight")
    if not per_channel and (group_k & (group_k - 1) or group_k < 16):
        raise ValueError(f"fp8_gemv: scale block size {group_k} along K must be a power of two >= 16")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"fp8_gemv: bias must be contiguous with shape ({n},), got {tuple(bias.shape)}")
    return per_channel


def _launch(
    x: torch.Tensor, k: int, w: torch.Tensor, w_scale: torch.Tensor, group_n: int, group_k: int,
    bias: torch.Tensor | None, config: StreamConfig | None, silu_mul: bool = False,
    norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None, x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    gated: bool = False, quant_group: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    a8 = x_scale is not None
    per_channel = _check(x, k, w, w_scale, group_n, group_k, bias, a8)
    m, n = x.shape[0], w.shape[0] // 2 if gated else w.shape[0]
    if gated:
        if w.shape[0] % 2:
            raise ValueError(f"fp8_gemv gated: w has {w.shape[0]} rows, must be [gate | up]: an even count")
        if not per_channel and n % group_n:
            raise ValueError(f"fp8_gemv gated: each half of w has {n} rows, must be a multiple of the "
                             f"{group_n}-row scale block (the up rows start a block)")
        if bias is not None:
            raise ValueError("fp8_gemv gated: takes no bias (silu·up would need gate's and up's before the product)")
    if quant_group:
        out = torch.empty((m, n), dtype=FP8_DTYPE, device=x.device)
        out_scale = torch.empty((m, triton.cdiv(n, quant_group)), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return (out, out_scale) if quant_group else out
    cap = tile_cap(group_n, group_k, k)
    cfg = config or default_stream_config(m, n, k, cap, sm_count(x.device))
    try:
        cfg.validate()
    except ValueError as e:
        raise ValueError(f"fp8_gemv: {e}") from e
    if not cfg.fp8_dot and cfg.block_n > cap:  # the FP8 dot scales each step's partial per row instead
        raise ValueError(f"fp8_gemv: block_n={cfg.block_n} spans two rows of {group_n}-row scale blocks "
                         f"(at most {cap}; the FP8 dot takes up to {MAX_BLOCK_N})")
    if cfg.fp8_dot and not (cfg.block_n >= 16 and (per_channel or cfg.block_k == group_k)):
        raise ValueError(f"fp8_gemv: fp8_dot needs block_n >= 16 (got {cfg.block_n}) and, with block "
                         f"scales, block_k equal to the scale block's {group_k} (got {cfg.block_k})")
    if cfg.use_dot and not cfg.fp8_dot and (x.dtype == torch.float32 or cfg.block_n < 16):
        cfg = dataclasses.replace(cfg, use_dot=False)  # fp32 x would be truncated to tf32; dot needs 16 rows
    if not cfg.use_dot and m > MAX_FMA_ROWS:
        raise ValueError(f"fp8_gemv: {m} rows take the dot path (at most {MAX_FMA_ROWS} on the FMA path), which "
                         f"needs block_n >= 16 (got {cfg.block_n}) and a 16-bit x (got {x.dtype})")
    if cfg.a8 != a8:
        raise ValueError(f"fp8_gemv: tiles {cfg} are for {'fp8' if cfg.a8 else 'bf16'} x, this call's is "
                         f"{'fp8 (fp8_gemv_a8)' if a8 else x.dtype}")
    half = cfg.block_n // 2 if gated else cfg.block_n  # output columns a program
    if gated and not (cfg.fp8_dot and cfg.block_n >= 32):
        raise ValueError(f"fp8_gemv gated: tiles must be FP8-dot tiles at least 32 rows tall (16 gate, 16 up), got "
                         f"{cfg}")
    if quant_group and not (gated and half == quant_group):
        raise ValueError(f"fp8_gemv: quant_group={quant_group} needs a gated tile of {quant_group} columns "
                         f"(block_n {2 * quant_group}), got block_n {cfg.block_n}{'' if gated else ' ungated'}")
    tiles, consts = triton.cdiv(n, half), tile_constants(m, k, cfg, group_n, group_k, per_channel)
    split_k = consts["SPLIT_K"]
    if a8:
        want = triton.cdiv(k, consts["BLOCK_K"])
        per_token = per_channel and x_scale.dim() == 2 and x_scale.shape[1] == 1
        if x_scale.dim() != 2 or x_scale.shape[0] < m or not (x_scale.shape[1] == want or per_token):
            raise ValueError(f"fp8_gemv_a8: x_scale [>= {m}, {want}] (one per row and {consts['BLOCK_K']} columns"
                             f"{', or one per row with per-channel weight scales' if per_channel else ''}), "
                             f"got {tuple(x_scale.shape)}")
        consts["X_TOKEN"] = per_token
    placeholder = out  # pointer arguments a disabled prologue (or split_k = 1) never dereferences
    parts, locks = placeholder, placeholder
    if split_k > 1:
        parts = torch.empty(tiles * split_k * cfg.block_n * consts["BLOCK_M"], dtype=torch.float32, device=x.device)
        locks = split_counters(x.device, tiles)
    act_dtype = out_dtype or x.dtype
    if act_dtype not in TL_DTYPES:
        raise ValueError(f"fp8_gemv: output dtype {act_dtype} is not one of {tuple(TL_DTYPES)}")
    _fp8_gemv_kernel[(tiles, split_k)](
        x, x_scale if a8 else placeholder, residual if residual is not None else placeholder, norm_weight if norm_weight is not None else placeholder,
        residual_out if residual_out is not None else placeholder, w, w_scale, bias if bias is not None else placeholder,
        out, out_scale if quant_group else placeholder, parts, locks, m, n, x.stride(0),
        x_scale.stride(0) if a8 else 0, x_scale.stride(1) if a8 else 0,
        residual.stride(0) if residual is not None else 0,
        residual_out.stride(0) if residual_out is not None else 0, w.stride(0), w_scale.stride(0), out.stride(0),
        out_scale.stride(0) if quant_group else 0,
        float(eps), SILU_MUL=silu_mul, ADD_RESIDUAL=residual is not None, NORM=norm_weight is not None,
        GATED=gated, QUANT_OUT=bool(quant_group), ACT_DTYPE=TL_DTYPES[act_dtype],
        HAS_BIAS=bias is not None, **consts,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device, "_fp8_gemv_kernel"),
    )  # fmt: skip
    return (out, out_scale) if quant_group else out


def tile_constants(m: int, k: int, cfg: StreamConfig, group_n: int, group_k: int, per_channel: bool) -> dict:
    """The kernel's tile constexprs for ``m`` rows of a K-``k`` weight under ``cfg`` (already checked), the
    grid's split count among them (benchmarks/kernel_ptxas.py compiles the same ones)."""
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    sub_k = block_k if per_channel else min(block_k, group_k)
    split_k = min(cfg.split_k, triton.cdiv(k, block_k))
    k_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    split_k = triton.cdiv(k, k_split)  # whole tiles per split can leave the last splits no K: never launched
    return {"K": k, "GROUP_N": 1 if per_channel else group_n, "GROUP_K": k if per_channel else group_k,
            "PER_CHANNEL": per_channel, "USE_DOT": cfg.use_dot,
            "BLOCK_M": max(16, triton.next_power_of_2(m)) if cfg.use_dot else triton.next_power_of_2(m),
            "BLOCK_N": cfg.block_n, "BLOCK_K": block_k, "SUB_K": sub_k, "KB": block_k // sub_k, "SPLIT_K": split_k,
            "K_SPLIT": k_split, "FP8_DOT": cfg.fp8_dot, "A8": cfg.a8, "X_TOKEN": False, "FP8_MAX_C": FP8_MAX, "MIN_SCALE_C": MIN_SCALE}  # fmt: skip


def fp8_gemv(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_n: int, group_k: int,
    bias: torch.Tensor | None = None, *, config: StreamConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """``x`` [M <= 64, K] (bf16/fp16/fp32; above 16 rows the dot path, 16-bit x only) times fp8 ``w`` [N, K]
    with fp32 scales ``w_scale`` [ceil(N/group_n), ceil(K/group_k)]; per-channel scales: ``group_n=1, group_k=K``, ``w_scale`` [N, 1].
    Output in x's dtype. ``config`` overrides the default tiles (the benchmark's sweep passes it)."""
    return _launch(x, x.shape[-1], w, w_scale, group_n, group_k, bias, config)


def fp8_gemv_a8(
    x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_n: int, group_k: int,
    out_dtype: torch.dtype, bias: torch.Tensor | None = None, *, config: StreamConfig,
) -> torch.Tensor:  # fmt: skip
    """``dequant(x) @ dequant(w).T`` for x already quantized: fp8 [M <= 64, K] with fp32
    ``x_scale`` [>= M, ceil(K / config.block_k)] (kernels/fp8_quant.per_token_group_quant with the tile's K step:
    the scale block's K), or, with per-channel weight scales, [>= M, 1] (per token: one dot chain over K).
    ``config`` must be an FP8-dot tile with ``a8``. One quantization launch before (fused
    with the norm or SiLU·mul that makes x, kernels/fp8_quant.py) saves every program quantizing x's rows
    again, and reads half of bf16 x's bytes."""
    return _launch(x, x.shape[-1], w, w_scale, group_n, group_k, bias, config, x_scale=x_scale, out_dtype=out_dtype)


def fp8_gate_up_a8(
    x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_n: int, group_k: int,
    act_dtype: torch.dtype, *, config: StreamConfig, quant_group: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``silu(x @ gate.T) * (x @ up.T)`` for ``w`` = [gate | up] [2N, K] (an MLP's merged gate_up projection) on x
    quantized as ``fp8_gemv_a8`` takes it: each program's tile holds ``config.block_n / 2`` gate rows and the up
    rows N further on, so the activation is computed in the epilogue and gate_up's [M, 2N] output is never
    written. Gate and up are each rounded to ``act_dtype`` first, as the projection would store them.

    Returns silu·up [M, N] in ``act_dtype``; with ``quant_group`` (= block_n / 2: one group a program), the next
    projection's W8A8 input instead: (fp8 [M, N], fp32 scales [M, N / quant_group]) as
    kernels/fp8_quant.silu_mul_group_quant would write it, and that launch is saved."""
    return _launch(x, x.shape[-1], w, w_scale, group_n, group_k, None, config, x_scale=x_scale, out_dtype=act_dtype,
                   gated=True, quant_group=quant_group)


def fp8_silu_mul_gemv(
    gate_up: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_n: int, group_k: int,
    bias: torch.Tensor | None = None, *, config: StreamConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """``fp8_gemv(silu(gate) * up, ...)`` for gate_up [M, 2K] = [gate | up]: the MLP's activation is
    computed in the loads (as kernels/gemv.py's silu_mul_gemv), saving a launch and a round trip."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"fp8_silu_mul_gemv takes gate_up [M, 2K], got {tuple(gate_up.shape)}")
    return _launch(gate_up, gate_up.shape[-1] // 2, w, w_scale, group_n, group_k, bias, config, silu_mul=True)


def fp8_norm_gemv(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor, w_scale: torch.Tensor,
    group_n: int, group_k: int, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
    *, config: StreamConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``(fp8_gemv(rms_norm(x [+ residual]), ...), x + residual or None)``, the norm in the loads with
    kernels/norm.py's numerics (as kernels/gemv.py's norm_gemv)."""
    m, k = x.shape
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        raise ValueError(f"fp8_norm_gemv: norm weight must be contiguous with shape ({k},), got "
                         f"{tuple(norm_weight.shape)}")
    residual_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise ValueError(f"fp8_norm_gemv: residual {tuple(residual.shape)} {residual.dtype} must match x "
                             f"{tuple(x.shape)} {x.dtype}, row-major")
        residual_out = torch.empty_like(x)
    out = _launch(x, k, w, w_scale, group_n, group_k, bias, config, norm_weight=norm_weight, eps=eps,
                  residual=residual, residual_out=residual_out)
    return out, residual_out
