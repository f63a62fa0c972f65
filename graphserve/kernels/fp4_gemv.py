"""Small-batch FP4-weight matmul for decode: ``x @ dequant(w).T`` with x in bf16 and w streamed as FP4.

At decode sizes a projection is a weight stream, and FP4 reads half FP8's bytes (0.5 byte a weight plus one
scale byte per 16 or 32). Hopper has no FP4 tensor cores, so each program streams its [BLOCK_N, K/2] slab of
packed bytes and widens them in registers (kernels/fp4_layout.py: masks and shifts, the power of two folded
into the block scale), as kernels/fp8_gemv.py does for fp8:

- FMA (M <= ``FMA_MAX_ROWS``): the tile kept as [BLOCK_N, K groups, group bytes], each x row split into its even
  and odd columns (the low and high nibbles), group sums in fp32 times the group's scale;
- dot: low and high nibble tiles widened, scaled (exact in bf16) and multiplied on the bf16 tensor cores
  against x's even and odd columns, x padded to 16-64 rows ("swap AB": the weight rows fill the tall side).

Prologues as kernels/gemv.py's (``_x_tile``): ``fp4_silu_mul_gemv`` computes silu(gate) * up and
``fp4_norm_gemv`` (residual add +) RMSNorm while loading x. Split-K where N is small against K (the down
projection), reduced in the same launch by the last program of each column tile (kernels/fp8_gemv.py's
counters, shared). PDL: waits first and releases the next kernel after its main loop, as the FP8 stream does.
Tiles are a pure function of the shape (``stream_config``): no autotuning, safe in CUDA-graph capture.

Measured on an H100 (benchmarks/results/fp4_kernels.json, llama3-8b's projections, 3.11 TB/s probed): at one row
0.85-1.18 TB/s (qkv 17 us against the FP8 stream's 12; gate_up 53-70 us against 44), so not yet at its bytes:
the widening's integer, conversion and scale work per byte sets the time. The dot path falls further behind
(qkv at 32 rows: 0.18-0.20 ms against the FP8 stream's 0.024), where the tiled GEMM's fp8 variant takes over
(kernels/fp4_rule.json). Where the cost goes next: the per-group 3-D tile and its reshape before the dot, the fp32
scale multiply per element (a bf16 product is exact), x's even and odd columns loaded apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import sm_count
from graphserve.kernels.fp4_layout import (
    DEFAULT_WIDEN,
    GROUP,
    WIDEN_UNIT_LOG2,
    block_scale,
    default_widen,
    fp4_check,
    row_global,
    widen_code,
    widen_fp16,
)
from graphserve.kernels.fp4_reference import fp4_dequantize
from graphserve.kernels.fp4_words import word_dot_step, word_fma_step, words_of
from graphserve.kernels.fp8_gemv import split_counters
from graphserve.kernels.gemv import _x_tile
from graphserve.kernels.norm import fused_add_rms_norm_reference, rms_norm_reference
from graphserve.kernels.pdl import pdl_args, pdl_release, pdl_wait

MAX_ROWS = 64
FMA_MAX_ROWS = 4  # from 5 rows on, M fp32 FMAs per widened weight approach the CUDA cores' peak (gemv_config)
X_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fp4StreamConfig:
    """Tiles of one streaming call: ``block_k`` in elements (a multiple of the scale group)."""

    block_n: int
    block_k: int
    split_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 2
    widen: str = "byte"  # "byte" (below) or fp4_layout.WIDENINGS' others (kernels/fp4_words.py: int32 words)


def stream_config(m: int, n: int, k: int, group: int, sms: int, widen: str = DEFAULT_WIDEN) -> Fp4StreamConfig:
    """Enough programs for every SM: the widest tile that still gives one per SM, then split-K until about
    two per SM. About 8 KB of packed bytes a tile keeps each thread's loads 16 bytes wide and several in
    flight; the dot tiles stay smaller in K (two widened bf16 copies live in registers)."""
    use_dot = m > FMA_MAX_ROWS
    widths = (64, 32, 16) if use_dot else (32, 16, 8)
    block_n = next((bn for bn in widths if triton.cdiv(n, bn) >= sms), widths[-1])
    block_k = 256 if use_dot else max(group * 2, 16384 // block_n)
    block_k = max(group, min(block_k, triton.next_power_of_2(k)))
    tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split_k = 1
    if tiles < 2 * sms:
        split_k = max(1, min(steps, 16, triton.cdiv(2 * sms, tiles)))
    return Fp4StreamConfig(block_n, block_k, split_k, use_dot, num_warps=4, num_stages=3 if use_dot else 2,
                           widen=widen)


@triton.jit
def _fp4_gemv_kernel(
    x_ptr, res_ptr, nw_ptr, res_out_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, stride_xm, stride_rm, stride_rom, stride_wn, stride_sn, stride_om, eps,
    K: tl.constexpr, GROUP_K: tl.constexpr, MX: tl.constexpr, HAS_GLOBAL: tl.constexpr, ROW_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD_RESIDUAL: tl.constexpr, NORM: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    K_SPLIT: tl.constexpr, WIDEN: tl.constexpr, UNIT: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    pid = tl.program_id(0)
    k_first = tl.program_id(1) * K_SPLIT
    KB: tl.constexpr = BLOCK_K // GROUP_K  # scale groups a step
    G2: tl.constexpr = GROUP_K // 2  # bytes a group
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    # rows past N re-read row N-1: unmasked, vectorised weight loads; never stored
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_g = tl.arange(0, KB)
    offs_j = tl.arange(0, G2)
    byte3 = offs_g[:, None] * G2 + offs_j[None, :]  # [KB, G2] byte offsets within a step
    w_ptrs = w_ptr + w_rows[:, None, None] * stride_wn + byte3[None, :, :]
    s_ptrs = s_ptr + w_rows[:, None] * stride_sn + offs_g[None, :]
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:  # as kernels/gemv.py: each program takes the rows' statistics itself; program 0 writes x + residual
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
    for kk in range(0, K_SPLIT, BLOCK_K):
        k0 = k_first + kk
        if WIDEN > 0 and USE_DOT:  # w_ptr holds int32 words here (kernels/fp4_words.py)
            acc = word_dot_step(acc, x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, w_rows, offs_m, rstd, M, k0, stride_xm,
                                stride_rm, stride_wn, stride_sn, K, GROUP_K, MX, SILU_MUL, ADD_RESIDUAL, NORM,
                                BLOCK_M, BLOCK_K, EVEN_K, WIDEN, UNIT)  # fmt: skip
        elif WIDEN > 0:
            acc = word_fma_step(acc, x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, w_rows, offs_m, rstd, M, k0, stride_xm,
                                stride_rm, stride_wn, stride_sn, K, GROUP_K, MX, SILU_MUL, ADD_RESIDUAL, NORM,
                                BLOCK_M, BLOCK_K, EVEN_K, WIDEN, UNIT)  # fmt: skip
        else:
            groups = k0 // GROUP_K + offs_g
            g_mask = groups < K // GROUP_K  # K is whole groups: a tail is masked by group
            if EVEN_K:
                b = tl.load(w_ptrs + k0 // 2)
                s = tl.load(s_ptrs + k0 // GROUP_K)
            else:
                b = tl.load(w_ptrs + k0 // 2, mask=g_mask[None, :, None], other=0)
                s = tl.load(s_ptrs + k0 // GROUP_K, mask=g_mask[None, :], other=0)
            lo, hi = widen_fp16(b.to(tl.int32))
            sf = block_scale(s, MX, 14)  # [BLOCK_N, KB], the fp16 unit (2^14) folded in
            cols = k0 + 2 * byte3  # [KB, G2] the even columns (low nibbles); odd ones one further
            k_mask = g_mask[:, None] & (offs_j[None, :] < G2)
            if USE_DOT:
                wl = tl.reshape((lo.to(tl.float32) * sf[:, :, None]).to(x_ptr.dtype.element_ty), (BLOCK_N, BLOCK_K // 2))
                wh = tl.reshape((hi.to(tl.float32) * sf[:, :, None]).to(x_ptr.dtype.element_ty), (BLOCK_N, BLOCK_K // 2))
                ce = tl.reshape(cols, (BLOCK_K // 2,))
                cm = tl.reshape(k_mask, (BLOCK_K // 2,))
                x_mask = (offs_m[:, None] < M) & cm[None, :]
                xe = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, offs_m[:, None], ce[None, :], x_mask,
                             rstd[:, None], K, SILU_MUL, ADD_RESIDUAL, NORM, x_ptr.dtype.element_ty)  # fmt: skip
                xo = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, offs_m[:, None], ce[None, :] + 1, x_mask,
                             rstd[:, None], K, SILU_MUL, ADD_RESIDUAL, NORM, x_ptr.dtype.element_ty)  # fmt: skip
                acc = tl.dot(wl, tl.trans(xe), acc)
                acc = tl.dot(wh, tl.trans(xo), acc)
            else:
                lof, hif = lo.to(tl.float32), hi.to(tl.float32)
                for m in tl.static_range(BLOCK_M):
                    rstd_m = tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
                    row_mask = k_mask & (m < M)
                    xe = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, m, cols, row_mask, rstd_m, K,
                                 SILU_MUL, ADD_RESIDUAL, NORM, x_ptr.dtype.element_ty).to(tl.float32)  # fmt: skip
                    xo = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, m, cols + 1, row_mask, rstd_m, K,
                                 SILU_MUL, ADD_RESIDUAL, NORM, x_ptr.dtype.element_ty).to(tl.float32)  # fmt: skip
                    part = tl.sum(tl.sum(lof * xe[None, :, :] + hif * xo[None, :, :], axis=2) * sf, axis=1)
                    acc += tl.where(offs_m[None, :] == m, part[:, None], 0.0)
    pdl_release(PDL)
    if SPLIT_K == 1:
        _epilogue(acc, gs_ptr, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_GLOBAL, ROW_GLOBAL, HAS_BIAS)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        parts = part_ptr + pid.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
        tl.store(parts + tl.program_id(1) * (BLOCK_N * BLOCK_M) + tile, acc)
        tl.debug_barrier()  # every thread's partial is written before the block counts itself done
        done = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for sp in tl.static_range(SPLIT_K):  # split order, whichever program came last: deterministic
                total += tl.load(parts + sp * (BLOCK_N * BLOCK_M) + tile, cache_modifier=".cg")
            _epilogue(total, gs_ptr, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_GLOBAL, ROW_GLOBAL, HAS_BIAS)
            tl.atomic_xchg(lock_ptr + pid, 0, sem="relaxed", scope="gpu")


@triton.jit
def _epilogue(acc, gs_ptr, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_GLOBAL: tl.constexpr,
              ROW_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """The fp32 tile [BLOCK_N, BLOCK_M] (rows the output columns) times the global scale (one value, or one per
    output row), plus the bias; stored in the output's dtype."""
    n_mask = offs_n < N
    if HAS_GLOBAL:
        if ROW_GLOBAL:
            acc = acc * tl.load(gs_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
        else:
            acc = acc * tl.load(gs_ptr)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_m[None, :] < M))


def _launch(x: torch.Tensor, k: int, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
            fmt: str, bias: torch.Tensor | None, out: torch.Tensor | None, config: Fp4StreamConfig | None,
            silu_mul: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    n, _ = fp4_check("fp4_gemv", packed, scale, global_scale, fmt, k)
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in X_DTYPES:
        raise ValueError(f"fp4_gemv: x must be row-major 2-D {X_DTYPES}, got {x.dtype} {tuple(x.shape)} "
                         f"strides {x.stride()}")
    m = x.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"fp4_gemv takes at most {MAX_ROWS} rows, got {m}: larger batches take fp4_gemm")
    per_row = row_global("fp4_gemv", global_scale, n)
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"fp4_gemv: bias must be contiguous with shape ({n},), got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"fp4_gemv: out must be [{m}, {n}] {x.dtype} row-major, got {out.dtype} {tuple(out.shape)}")
    if m == 0 or n == 0:
        return out
    group = GROUP[fmt]
    cfg = config or stream_config(m, n, k, group, sm_count(x.device), widen=default_widen(x.device))
    if cfg.block_k % group or cfg.block_k & (cfg.block_k - 1):
        raise ValueError(f"fp4_gemv: block_k={cfg.block_k} must be a power of two and a multiple of {group}")
    if cfg.use_dot and cfg.block_n < 16:
        raise ValueError(f"fp4_gemv: the dot path needs block_n >= 16, got {cfg.block_n}")
    if not cfg.use_dot and m > 16:
        raise ValueError(f"fp4_gemv: {m} rows take the dot path (the FMA path unrolls at most 16)")
    widen = widen_code("fp4_gemv", cfg.widen, x.device)
    words = widen > 0
    if words and cfg.use_dot and cfg.block_k < 128:
        raise ValueError(f"fp4_gemv: widen={cfg.widen!r} on the dot path needs block_k >= 128 (each of its eight dots "
                         f"takes block_k / 8 >= 16 columns), got {cfg.block_k}")
    block_k = min(cfg.block_k, max(group, triton.next_power_of_2(k)))
    steps = triton.cdiv(k, block_k)
    k_split = triton.cdiv(steps, min(cfg.split_k, steps)) * block_k
    split_k = triton.cdiv(k, k_split)  # whole steps a split: trailing splits with no K are never launched
    block_m = max(16, triton.next_power_of_2(m)) if cfg.use_dot else triton.next_power_of_2(m)
    tiles = triton.cdiv(n, cfg.block_n)
    placeholder = out
    parts = locks = placeholder
    if split_k > 1:
        parts = torch.empty(tiles * split_k * cfg.block_n * block_m, dtype=torch.float32, device=x.device)
        locks = split_counters(x.device, tiles)
    w = words_of(packed, "fp4_gemv") if words else packed
    _fp4_gemv_kernel[(tiles, split_k)](
        x, residual if residual is not None else placeholder, norm_weight if norm_weight is not None else placeholder,
        residual_out if residual_out is not None else placeholder, w, scale.view(torch.uint8),
        global_scale if global_scale is not None else placeholder, bias if bias is not None else placeholder,
        out, parts, locks, m, n, x.stride(0), residual.stride(0) if residual is not None else 0,
        residual_out.stride(0) if residual_out is not None else 0, w.stride(0), scale.stride(0), out.stride(0),
        float(eps), K=k, GROUP_K=group, MX=fmt == "mxfp4", HAS_GLOBAL=global_scale is not None,
        ROW_GLOBAL=per_row, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ADD_RESIDUAL=residual is not None,
        NORM=norm_weight is not None, USE_DOT=cfg.use_dot, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, K_SPLIT=k_split, WIDEN=widen, UNIT=WIDEN_UNIT_LOG2[widen],
        EVEN_K=k % k_split == 0 and k_split % block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(x.device, "_fp4_gemv_kernel"),
    )  # fmt: skip
    return out


def fp4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
             fmt: str, bias: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
             config: Fp4StreamConfig | None = None) -> torch.Tensor:  # fmt: skip
    """``x`` [M <= 64, K] (bf16/fp16) times the FP4 weight ``packed`` [N, K/2] with its block ``scale`` and
    (NVFP4) ``global_scale``: one value, or fp32 [N] one per output row (fused parts with different globals);
    fp32 accumulation, x's dtype out. ``config`` overrides the tiles (benchmarks)."""
    return _launch(x, x.shape[-1], packed, scale, global_scale, fmt, bias, out, config)


def fp4_silu_mul_gemv(gate_up: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                      global_scale: torch.Tensor | None, fmt: str, bias: torch.Tensor | None = None, *,
                      config: Fp4StreamConfig | None = None) -> torch.Tensor:  # fmt: skip
    """``fp4_gemv(silu(gate) * up, ...)`` for gate_up [M, 2K] = [gate | up], the activation in the loads."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"fp4_silu_mul_gemv takes gate_up [M, 2K], got {tuple(gate_up.shape)}")
    return _launch(gate_up, gate_up.shape[-1] // 2, packed, scale, global_scale, fmt, bias, None, config,
                   silu_mul=True)


def fp4_norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, packed: torch.Tensor, scale: torch.Tensor,
                  global_scale: torch.Tensor | None, fmt: str, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, *,
                  config: Fp4StreamConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``(fp4_gemv(rms_norm(x [+ residual]), ...), x + residual or None)``, kernels/norm.py's numerics."""
    m, k = x.shape
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        raise ValueError(f"fp4_norm_gemv: norm weight must be contiguous ({k},), got {tuple(norm_weight.shape)}")
    residual_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise ValueError(f"fp4_norm_gemv: residual {tuple(residual.shape)} {residual.dtype} must match x "
                             f"{tuple(x.shape)} {x.dtype}, row-major")
        residual_out = torch.empty_like(x)
    out = _launch(x, k, packed, scale, global_scale, fmt, bias, None, config, norm_weight=norm_weight, eps=eps,
                  residual=residual, residual_out=residual_out)
    return out, residual_out


def fp4_gemv_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       global_scale: torch.Tensor | None, fmt: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x @ dequant(w).T (+ bias)`` (kernels/fp4_reference.fp4_linear_reference before its rounding)."""
    out = x.float() @ fp4_dequantize(packed, scale, global_scale, fmt).T
    return out + bias.float() if bias is not None else out


def fp4_silu_mul_gemv_reference(gate_up, packed, scale, global_scale, fmt, bias=None) -> torch.Tensor:
    """fp32 matmul of silu(gate) * up computed in fp32 and rounded to the input dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    x = (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)
    return fp4_gemv_reference(x, packed, scale, global_scale, fmt, bias)


def fp4_norm_gemv_reference(x, norm_weight, eps, packed, scale, global_scale, fmt, bias=None, residual=None):
    """fp32 matmul of the reference RMSNorm (of x + residual rounded to x's dtype), and that sum."""
    if residual is None:
        return fp4_gemv_reference(rms_norm_reference(x, norm_weight, eps), packed, scale, global_scale, fmt, bias), None
    h, summed = fused_add_rms_norm_reference(x, residual, norm_weight, eps)
    return fp4_gemv_reference(h, packed, scale, global_scale, fmt, bias), summed

